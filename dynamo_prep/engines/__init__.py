"""Engines as the worker sees them: what each one declares, and a GPU-free mock that checks it.

* ``sglang``: reads the per-image token from the multimodal processor SGLang actually loaded
  (``engine.tokenizer_manager.mm_processor.mm_tokens.image_token``), plus stand-ins shaped like
  SGLang's classes for tests and the mock (real SGLang needs a GPU).
* ``vllm``: declares nothing; vLLM expands the checkpoint's own placeholder string.
* ``mock``: ``MockEngine``, which enforces either engine's real image contract on the token ids
  it receives and streams a deterministic reply, like Dynamo's mocker.

Each accessor takes the engine as a plain ``object`` and reads it with ``getattr``, so this
package never imports SGLang or vLLM.
"""
