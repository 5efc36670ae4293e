"""``dynamo-prep frontend``: read the options, then serve in this process or supervise N of them.

One process (the default) runs ``serve.py``'s components on its own event loop. With
``--http-workers N`` (N > 1) a supervisor (``http_supervisor.py``) runs N such processes, each binding the
HTTP port with SO_REUSEPORT. Logging is configured by the CLI, never here.
"""

from __future__ import annotations

from typing import Any

import structlog

from dynamo_prep.discovery.trust import TrustError
from dynamo_prep.frontend.config import FrontendConfig
from dynamo_prep.frontend.serve import run_in_loop, serve_frontend
from dynamo_prep.lifecycle import EXIT_CONFIG

__all__ = ["run_frontend"]

log = structlog.get_logger("dynamo_prep.frontend")


def run_frontend(**options: Any) -> int:
    """Blocking entry point of ``dynamo-prep frontend``; ``options`` are ``FrontendConfig.from_options``'s."""
    try:
        config = FrontendConfig.from_options(**options)
    except (TrustError, ValueError) as exc:
        log.error("frontend_config_error", error=str(exc))
        return EXIT_CONFIG
    if config.http_workers > 1:
        from dynamo_prep.frontend.http_supervisor import run_workers  # noqa: PLC0415 - the supervisor only

        return run_workers(config)
    return run_in_loop(serve_frontend(config))
