"""The frontend process: discovery watcher, request router and OpenAI HTTP API on one event loop.

Import the modules themselves (``dynamo_prep.frontend.process``, ``...config``, ...): this package
re-exports nothing, so reading the frontend's defaults does not load the HTTP stack.
"""
