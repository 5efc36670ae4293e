"""The vLLM bridge: ``translate`` (pure) and ``runtime`` (imports vLLM when a worker starts one)."""
