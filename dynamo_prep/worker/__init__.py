"""The worker side: announce a model card and serve the request plane for an engine.

* ``server``: ``Worker`` (request-plane ROUTER + card publisher) and its message dispatcher;
* ``generate``: ``GenerationServer`` (Generate / Cancel / Ping, deadlines, graceful drain);
* ``metrics``: the worker's own ``dynamo_worker_*`` metrics and their HTTP server;
* ``register``: ``register(engine, ...)``, what a real SGLang or vLLM worker process calls;
* ``process``: the ``dynamo-prep worker`` process (``WorkerConfig``, ``run_worker``).
"""

from __future__ import annotations

from dynamo_prep.worker.process import WorkerConfig, run_worker
from dynamo_prep.worker.register import register
from dynamo_prep.worker.server import Worker

__all__ = ["Worker", "WorkerConfig", "register", "run_worker"]
