"""The command line as users meet it: every option explained, global options anywhere."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from dynamo_prep.cli import _parser


def commands(
    parser: argparse.ArgumentParser, path: str = "dynamo-prep"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, f"{path} {name}")


COMMANDS = dict(commands(_parser()))


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_every_option_has_a_help_line(path: str) -> None:
    parser = COMMANDS[path]
    missing = [
        "/".join(action.option_strings) or action.dest
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        and (not action.help or action.help == argparse.SUPPRESS)
    ]
    assert not missing, f"{path}: options without a help line: {missing}"


@pytest.mark.parametrize(
    "command", ["frontend", "worker --model-path m --discovery tcp://x:1", "watch", "up"]
)
def test_global_options_work_before_and_after_the_subcommand(command: str) -> None:
    argv = command.split()
    after = _parser().parse_args([*argv, "--log-format", "console", "--log-level", "debug"])
    assert (after.log_format, after.log_level) == ("console", "debug")
    before = _parser().parse_args(["--log-format", "console", *argv])
    assert (before.log_format, before.log_level) == ("console", "info")
    both = _parser().parse_args(["--log-level", "warning", *argv, "--log-level", "error"])
    assert both.log_level == "error"  # the later (more specific) one wins


def test_environment_variables_set_defaults_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_HTTP_PORT", "9123")
    monkeypatch.setenv("DYN_ROUTER_TEMPERATURE", "0.5")
    assert _parser().parse_args(["frontend"]).http_port == 9123
    assert _parser().parse_args(["frontend"]).router_temperature == 0.5
    assert _parser().parse_args(["frontend", "--http-port", "9"]).http_port == 9


def test_a_malformed_environment_variable_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DYN_HTTP_WORKERS", "two")
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["frontend"])
    assert exit_info.value.code == 2
    assert "--http-workers: invalid int value: 'two'" in capsys.readouterr().err
