"""The HTTP API, one module per surface, each exporting ``routes(api)``: ``chat``, ``completions``,
``responses``, ``models``, ``tokenize`` (and detokenize), ``probes`` (health, live, metrics).
What they share: ``common`` (state, body, SSE), ``journeys`` (the chat path), ``params`` (a surface's
parameter names), ``failures`` (error answers). Adding an endpoint: docs/frontend.md."""
