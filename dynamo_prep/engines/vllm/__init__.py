"""The vLLM bridge: ``contract`` and ``translate`` (pure) and ``runtime`` (imports vLLM lazily)."""
