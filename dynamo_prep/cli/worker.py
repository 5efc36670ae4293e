"""``dynamo-prep worker``: its parser and its handler, both from ``worker.options.WORKER_OPTIONS``."""

from __future__ import annotations

import argparse
from typing import Any

from dynamo_prep.worker.options import WORKER_DESCRIPTION, WORKER_OPTIONS

__all__ = ["add_worker"]


def add_worker(commands: Any) -> None:
    worker = commands.add_parser(
        "worker",
        help="announce a model card and serve the request plane",
        description=WORKER_DESCRIPTION,
        allow_abbrev=False,  # an engine flag must never be taken for a prefix of one of ours
    )
    WORKER_OPTIONS.add_to(worker)
    worker.set_defaults(handler=_worker)


def _worker(args: argparse.Namespace) -> int:
    from dynamo_prep.worker.process import run_worker  # noqa: PLC0415 - keep start-up light

    return run_worker(**WORKER_OPTIONS.values(args), engine_args=args.engine_args)
