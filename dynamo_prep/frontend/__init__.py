"""The frontend process: discovery watcher now, HTTP serving next to it (the "Serving" issue)."""

from dynamo_prep.frontend.process import FrontendConfig, run_frontend, serve_frontend

__all__ = ["FrontendConfig", "run_frontend", "serve_frontend"]
