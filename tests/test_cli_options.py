"""Options declared once: a subcommand's flags are one table that builds its parser and fills its config."""

from __future__ import annotations

import inspect

import pytest

from dynamo_prep.cli import _parser, parse_args
from dynamo_prep.cli.render import render_request
from dynamo_prep.cli.tables import BROKER_OPTIONS, RENDER_OPTIONS, UP_OPTIONS, WATCH_OPTIONS
from dynamo_prep.cli.up import run_up
from dynamo_prep.cli.watch import run_watch
from dynamo_prep.discovery.broker import run_broker
from dynamo_prep.frontend.config import FrontendConfig
from dynamo_prep.frontend.options import FRONTEND_OPTIONS
from dynamo_prep.options import Options
from dynamo_prep.worker.config import WorkerConfig
from dynamo_prep.worker.options import WORKER_OPTIONS

GLOBAL_FLAGS = {"-h", "--help", "--log-level", "--log-format"}


# Each subcommand declared by a table: its table, its validated config, the keywords given besides.
TABLES = {
    "worker": (WORKER_OPTIONS, WorkerConfig.from_options, {"engine_args"}),
    "frontend": (FRONTEND_OPTIONS, FrontendConfig.from_options, set()),
    "render": (RENDER_OPTIONS, render_request, {"request"}),
    "up": (UP_OPTIONS, run_up, {"log_level"}),
    "watch": (WATCH_OPTIONS, run_watch, {"stream"}),
    "broker": (BROKER_OPTIONS, run_broker, set()),
}


def _flags_of(command: str) -> set[str]:
    subcommands = next(action for action in _parser()._actions if action.dest == "command")
    parser = subcommands.choices[command]  # type: ignore[index]
    return {flag for action in parser._actions for flag in action.option_strings}


@pytest.mark.parametrize("command", TABLES)
def test_every_flag_is_declared_in_the_table_and_nowhere_else(command: str) -> None:
    table: Options = TABLES[command][0]
    declared = {
        flag for option in table if option.flag.startswith("-") for flag in (option.flag, *option.aliases)
    }
    assert _flags_of(command) - GLOBAL_FLAGS == declared


@pytest.mark.parametrize("command", TABLES)
def test_the_table_fills_every_keyword_of_the_validated_config(command: str) -> None:
    table, from_options, besides = TABLES[command]
    assert table.keys() | besides == set(inspect.signature(from_options).parameters)


def test_parsed_flags_become_a_validated_config() -> None:
    args = parse_args(
        ["worker", "--model-path", "kimi-k3-demo", "--discovery", "tcp://127.0.0.1:7555,tcp://127.0.0.1:7557",
         "--flavor", "vllm", "--kv-events", "--kv-blocks", "64",
         "--allowed-media-networks", "10.0.0.0/8,127.0.0.1/32", "--heartbeat", "0.5", "--drain-timeout", "2"]
    )  # fmt: skip
    config = WorkerConfig.from_options(**WORKER_OPTIONS.values(args), engine_args=args.engine_args)
    assert config.discovery == ("tcp://127.0.0.1:7555", "tcp://127.0.0.1:7557")
    assert (config.flavor, config.kv_events, config.kv_blocks) == ("vllm", True, 64)
    assert (config.heartbeat_s, config.drain_timeout_s) == (0.5, 2.0)
    assert (
        config.media
        == WorkerConfig.from_options(
            model_path="kimi-k3-demo", discovery=["x"], allowed_media_networks=["10.0.0.0/8", "127.0.0.1/32"]
        ).media
    )


def test_a_wrong_value_is_refused_by_the_config_naming_the_flag() -> None:
    args = parse_args(["worker", "--model-path", "kimi-k3-demo", "--discovery", "tcp://a:1", "--slots", "0"])
    with pytest.raises(ValueError, match="--slots must be >= 1, got 0"):
        WorkerConfig.from_options(**WORKER_OPTIONS.values(args), engine_args=args.engine_args)
