"""The frontend process: discovery watcher, request router and OpenAI HTTP API on one event loop."""

from dynamo_prep.frontend.process import FrontendConfig, run_frontend, serve_frontend

__all__ = ["FrontendConfig", "run_frontend", "serve_frontend"]
