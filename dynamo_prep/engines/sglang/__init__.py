"""The SGLang bridge: ``declare`` and ``translate`` (pure) and ``runtime`` (imports SGLang lazily)."""
