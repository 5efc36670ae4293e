"""Engines as the worker sees them: the contract, what each one declares, and a GPU-free mock.

* ``base``: the engine contract (``EngineContractError``, ``EngineOutput``, ``Flavor``).
* ``sglang``: reads the per-image token from the multimodal processor SGLang actually loaded
  (``engine.tokenizer_manager.mm_processor.mm_tokens.image_token``); ``sglang_standins``: objects
  shaped like SGLang's classes, for tests and the mock (real SGLang needs a GPU).
* ``vllm``: declares nothing; vLLM expands the checkpoint's own placeholder string.
* ``declare``: the declared token for an engine of either flavor.
* ``mock``: ``MockEngine``, which enforces either engine's real image contract on the token ids
  it receives and streams a deterministic reply, like Dynamo's mocker (``mock_prompt`` reads the
  prompt, ``mock_replies`` loads scripted replies, ``mock_answer`` writes the model's format).
* ``kv_cache``: ``PagedPrefixCache``, the mock's paged prefix cache emitting vLLM's KV events;
  ``kv_publisher``: ``KvEventPublisher``, vLLM's ZeroMQ publisher with its replay ROUTER;
  ``mock_kv``: ``MockKvEngine``, the mock behind that cache (``--kv-events``).
* ``kv_config``: what a real engine's ``--kv-events-config`` advertises in the announce.

Each accessor takes the engine as a plain ``object`` and reads it with ``getattr``, so this
package never imports SGLang or vLLM.
"""
