"""The ``dynamo-prep`` command line: one subcommand per process kind.

Heavy modules are imported inside each handler, so ``render`` does not pay for ZeroMQ and a
worker does not pay for the HTTP stack. Defaults are read from the light modules that own them;
global options (``--log-level``, ``--log-format``) are accepted before or after the subcommand.
Each subcommand's flags are declared once, in a table (``options.Options``) that builds its parser
and gives its handler's keywords: ``worker.options``, ``frontend.options`` and ``tables`` (the
others). ``up``, ``watch`` and ``render`` are the commands that live here whole.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamo_prep.cli.tables import (
    BROKER_OPTIONS,
    KEYS_GENERATE_OPTIONS,
    RENDER_OPTIONS,
    UP_OPTIONS,
    WATCH_OPTIONS,
)
from dynamo_prep.cli.worker import add_worker
from dynamo_prep.frontend.options import FRONTEND_OPTIONS
from dynamo_prep.lifecycle import EXIT_FAILED
from dynamo_prep.logging import configure_logging

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "console")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dynamo-prep`` console script."""
    args = parse_args(argv)
    # render's stdout is its result, so its logs go to stderr; every other process logs to stdout.
    stream = sys.stderr if args.command in ("render", "keys", "watch") else sys.stdout
    configure_logging(level=args.log_level, log_format=args.log_format, stream=stream, component=args.command)
    result: int = args.handler(args)
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, in two stages for ``worker``: the flags it does not know are a real
    engine's own (``engine_args``, parsed by the engine's parser when it starts, in order);
    every other command refuses unknown flags."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "worker":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.engine_args = unknown
    return args


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynamo-prep", description="Frontend preprocessor for LLM serving.")
    _add_global(parser, level=_env("DYN_LOG_LEVEL", "info"), log_format=_env("DYN_LOG_FORMAT", "json"))
    commands = _Subcommands(parser.add_subparsers(dest="command", required=True))
    _add_render(commands)
    add_worker(commands)
    _add_frontend(commands)
    _add_broker(commands)
    _add_keys(commands)
    _add_up(commands)
    _add_watch(commands)
    return parser


def _add_global(parser: argparse.ArgumentParser, *, level: Any, log_format: Any) -> None:
    """The process-wide options; on a subcommand they default to SUPPRESS, so the top level's
    value stands unless the option is given after the subcommand."""
    parser.add_argument(
        "--log-level",
        default=level,
        choices=LOG_LEVELS,
        help="log threshold (env DYN_LOG_LEVEL; default info)",
    )
    parser.add_argument(
        "--log-format",
        default=log_format,
        choices=LOG_FORMATS,
        help="json lines for machines, console for people (env DYN_LOG_FORMAT; default json)",
    )


class _Subcommands:
    """``add_parser`` that gives every subcommand the global options too."""

    def __init__(self, actions: Any) -> None:
        self._actions = actions

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self._actions.add_parser(name, **kwargs)
        _add_global(parser, level=argparse.SUPPRESS, log_format=argparse.SUPPRESS)
        return parser


def _add_render(commands: Any) -> None:
    render = commands.add_parser("render", help="render and tokenize one chat request, print JSON")
    RENDER_OPTIONS.add_to(render)
    render.set_defaults(handler=_render)


def _add_frontend(commands: Any) -> None:
    frontend = commands.add_parser("frontend", help="watch the discovery plane and serve the live models")
    FRONTEND_OPTIONS.add_to(frontend)
    frontend.set_defaults(handler=_frontend)


def _add_up(commands: Any) -> None:
    up = commands.add_parser(
        "up", help="a local cluster: frontend, an sglang and a vllm mock worker, a llama3-demo tool worker"
    )
    UP_OPTIONS.add_to(up)
    up.set_defaults(handler=_up)


def _add_broker(commands: Any) -> None:
    broker = commands.add_parser("broker", help="XSUB/XPUB forwarder for several frontends")
    BROKER_OPTIONS.add_to(broker)
    broker.set_defaults(handler=_broker)


_WATCH_HELP = """\
Show the discovery plane live: models, instances, each instance's declared image token (or
"checkpoint default"), legacy card keys, endpoint, heartbeat age and seq. It subscribes like a
frontend and applies the frontend's own rules (TTL, withdraw, checksums); it never fetches files.

Reaching the plane (a worker publishes only to the addresses in its own --discovery list):
  * behind brokers: dynamo-prep watch --discovery tcp://broker-a:7556,tcp://broker-b:7556
    (the brokers' XPUB ports, exactly like a frontend started with --discovery);
  * embedded plane: dynamo-prep watch --bind tcp://0.0.0.0:7557 and start the workers with
    --discovery tcp://FRONTEND:7555,tcp://WATCH-HOST:7557 (they publish to both).
Logs go to stderr; stdout is the table, or with --json one JSON line per change."""


def _add_watch(commands: Any) -> None:
    watch = commands.add_parser(
        "watch",
        help="live view of the discovery plane (who announced what)",
        description=_WATCH_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    WATCH_OPTIONS.add_to(watch)
    watch.set_defaults(handler=_watch)


def _add_keys(commands: Any) -> None:
    keys = commands.add_parser("keys", help="CURVE key management")
    actions = keys.add_subparsers(dest="action", required=True)
    generate = actions.add_parser("generate", help="write NAME.key (public) and NAME.key_secret into DIR")
    KEYS_GENERATE_OPTIONS.add_to(generate)
    generate.set_defaults(handler=_keys_generate)


def _render(args: argparse.Namespace) -> int:
    from dynamo_prep.cli.render import render_request  # noqa: PLC0415 - keep start-up light

    try:
        output = render_request(_read_request(args.request), **RENDER_OPTIONS.values(args))
    except (ValueError, OSError) as exc:  # PreprocessError, ModelCardError, TokenizerError, ...
        _print_error(exc)
        return EXIT_FAILED
    print(_render_json(output))
    return 0


def _render_json(output: dict[str, Any]) -> str:
    """Valid JSON, one key per line and one segment per line, so people can read it too."""
    lines = []
    for key, value in output.items():
        if key == "segments" and value:
            items = ",\n".join(f"    {json.dumps(item, ensure_ascii=False)}" for item in value)
            rendered = f"[\n{items}\n  ]"
        else:
            rendered = json.dumps(value, ensure_ascii=False)
        lines.append(f"  {json.dumps(key)}: {rendered}")
    return "{\n" + ",\n".join(lines) + "\n}"


def _frontend(args: argparse.Namespace) -> int:
    from dynamo_prep.frontend.process import run_frontend  # noqa: PLC0415

    return run_frontend(**FRONTEND_OPTIONS.values(args))


def _up(args: argparse.Namespace) -> int:
    from dynamo_prep.cli.up import run_up  # noqa: PLC0415

    return run_up(**UP_OPTIONS.values(args), log_level=args.log_level)


def _broker(args: argparse.Namespace) -> int:
    from dynamo_prep.discovery.broker import run_broker  # noqa: PLC0415

    return run_broker(**BROKER_OPTIONS.values(args))


def _watch(args: argparse.Namespace) -> int:
    from dynamo_prep.cli.watch import run_watch  # noqa: PLC0415

    return run_watch(**WATCH_OPTIONS.values(args))


def _keys_generate(args: argparse.Namespace) -> int:
    from dynamo_prep.discovery.trust import generate_keys  # noqa: PLC0415

    public, secret = generate_keys(**KEYS_GENERATE_OPTIONS.values(args))
    print(json.dumps({"public_key_file": str(public), "secret_key_file": str(secret)}))
    return 0


def _read_request(path: Path) -> Any:
    text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: request is not valid JSON: {exc}") from exc


def _print_error(exc: Exception) -> None:
    error = {"message": str(exc), "type": "invalid_request_error", "code": 400}
    print(json.dumps({"error": error}, ensure_ascii=False), file=sys.stderr)
