"""Discovery plane: workers announce model cards over ZeroMQ, frontends keep the live model set.

Import the modules themselves (``dynamo_prep.discovery.watcher``, ``...broker``, ...): this package
re-exports nothing, so a broker or a watch process never loads the formatter stack.
"""
