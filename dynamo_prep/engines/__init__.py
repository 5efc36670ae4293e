"""Engines as the worker sees them: the contract, the bridges to real engines, and a mock.

* ``base``: the engine contract (``EngineOutput``, ``EngineError`` and its statuses,
  ``EngineFacts``, ``EngineRuntime``); ``steps``: what every real bridge shares (the
  step it yields, stop ids, sampling values); ``images``: the bounded image fetcher, with
  ``media_policy`` (where images may come from) and ``image_net`` (its checked connections).
* ``registry``: the table of engines, one ``bridge.EngineBridge`` per engine folder (its name,
  flag checks, start, KV-events dialect, the contract the mock emulates); callers ask it, never
  an engine's name (docs/engines.md, "Adding an engine").
* ``vllm`` / ``sglang``: one folder per real engine (its ``bridge``), in two parts: pure
  translation (request -> engine call, engine output -> ``EngineOutput``; no engine import) and
  a thin runtime adapter that imports the engine lazily. SGLang's ``declare`` reads the
  per-image token from the processor SGLang actually loaded; vLLM declares nothing (it expands
  the checkpoint's own placeholder string); each ``contract`` is what the mock enforces for it.
* ``kv_config``: what a real engine's ``--kv-events-config`` advertises in the announce.
* ``mock``: the GPU-free engine that enforces either engine's image contract (its own folder).

Nothing here imports SGLang, vLLM or torch at import time.
"""
