"""The GPU-free mock engine, like Dynamo's mocker, that enforces a real engine's image contract.

* ``engine``: ``MockEngine`` (checks the prompt the way SGLang or vLLM would, streams a
  deterministic reply) and ``MockContinuation`` (resumes a migrated request);
* ``prompt`` reads the prompt's ids, ``replies`` loads scripted replies, ``answer`` writes the
  model's own answer format;
* ``kv_cache``: ``PagedPrefixCache``, a paged prefix cache emitting vLLM's KV events;
  ``kv_publisher``: ``KvEventPublisher``, vLLM's ZeroMQ publisher with its replay ROUTER;
  ``kv``: ``MockKvEngine``, the mock behind that cache (``--kv-events``);
* ``scheduler``: ``MockScheduler``, a bounded batch with a waiting queue and a core that can hang
  (``--slots``, the worker's fault signals);
* ``standins``: objects shaped like SGLang's classes, for the mock's declaration and for tests.
"""
