"""The worker side: announce a model card and serve the request plane for an engine.

* ``config``: ``WorkerConfig``, the validated ``dynamo-prep worker`` options and their defaults;
* ``server``: ``Worker`` (request-plane ROUTER + card publisher, and the KV-event publisher's
  address in every announce) and its message dispatcher;
* ``generate``: ``GenerationServer`` (Generate / Cancel / Ping, deadlines, graceful drain);
* ``metrics``: the worker's own ``dynamo_worker_*`` metrics and their HTTP server;
* ``register``: ``register(engine, ...)``, what a real SGLang or vLLM worker process calls (it
  advertises the engine's own ``--kv-events-config`` publisher);
* ``process``: the ``dynamo-prep worker`` process (``run_worker``).

Import the modules themselves (``dynamo_prep.worker.register``, ...): this package re-exports
nothing, so reading the worker's defaults does not load ZeroMQ or the tokenizer.
"""
