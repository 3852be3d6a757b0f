"""`pagellm serve --help` and `generate --help` fit one screen and point at `--help-all`, which lists every flag in
its group; every flag's help shows its default; hiding a flag's help changes nothing it parses."""

from __future__ import annotations

import argparse
import re

import pytest

from pagellm.cli import HELP_GROUPS, build_parser, engine_config_from_args
from pagellm.config import EngineConfig

SCREEN_LINES = 60


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _help(capsys, monkeypatch, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps at the terminal's width
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(list(argv))
    assert stop.value.code == 0
    return capsys.readouterr().out


def _flags(action: argparse.Action) -> list[str]:
    return [s for s in action.option_strings if s.startswith("--")] or [action.metavar or action.dest]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_fits_one_screen_and_points_at_help_all(capsys, monkeypatch, command):
    text = _help(capsys, monkeypatch, command, "--help")
    assert len(text.splitlines()) <= SCREEN_LINES, text
    assert f"pagellm {command} --help-all" in text and "--model" in text
    assert "--cuda-graph-sizes" not in text and "--master-port" not in text  # the rare flags wait for --help-all


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_all_shows_every_flag_in_its_group_in_reading_order(capsys, monkeypatch, command):
    text = _help(capsys, monkeypatch, command, "--help-all")
    for action in _subparser(command)._actions:
        for flag in _flags(action):
            assert flag in text, flag
    titles = [line[:-1] for line in text.splitlines() if line[:-1] in HELP_GROUPS and line.endswith(":")]
    assert titles == [g for g in HELP_GROUPS if g in titles] and len(titles) == 7
    sections = text.split("\n\n")
    gpu = next(s for s in sections if s.startswith("GPU:"))
    assert "--cuda-graph-sizes" in gpu and "--gpu-memory-utilization" in gpu and "--enforce-eager" in gpu
    assert "--tensor-parallel-size" in next(s for s in sections if s.startswith("distributed:"))


# A value named as the default: "(default: 8000)", "(default 4 MiB)", "Default: X", "default on a CPU: X",
# "auto (the default)", "auto, the default, ...", "off by default"
SAYS_ITS_DEFAULT = re.compile(r"\(default[: ][^)]+\)|\bdefault( on a \w+)?: \S|\w+ \(the default\b"
                              r"|\w+, the default\b|\w+ by default\b", re.I)


@pytest.mark.parametrize("command", ["serve", "generate", "worker"])
def test_every_flag_shows_its_default(command):
    for action in _subparser(command)._actions:
        if action.required or isinstance(action, argparse._HelpAction) or action.default is argparse.SUPPRESS:
            continue
        for text in (getattr(action, "full_help", action.help), action.help):  # --help-all's and --help's
            if text is not argparse.SUPPRESS:
                shown = text % dict(vars(action), prog="pagellm")
                assert SAYS_ITS_DEFAULT.search(shown), f"{_flags(action)}: {text}"


def test_help_shows_defaults_in_words(capsys, monkeypatch):
    text = " ".join(_help(capsys, monkeypatch, "serve", "--help-all").split())
    for shown in ("(default: 8000)", "(default: 127.0.0.1)", "Tokens per KV block (default: 16)",
                  "(default: 64)", "(default: 2048)", "(default: on)", "(default: the model's own)"):
        assert shown in text, shown
    assert "default: None" not in text and "default: True" not in text


def test_the_short_help_changes_nothing_parsed():
    """A flag whose help --help hides still parses, and every default is the config's."""
    args = build_parser().parse_args(["serve", "--master-port", "1234", "--no-heap-tuning"])
    assert (args.master_port, args.heap_tuning) == (1234, False)
    defaults = engine_config_from_args(build_parser().parse_args(["serve"]))
    assert defaults == EngineConfig()
    assert engine_config_from_args(build_parser().parse_args(["generate", "--prompt", "x"])) == EngineConfig()


def test_served_model_name_takes_several_names():
    from pagellm.server.run import configs_from

    args = build_parser().parse_args(["serve", "m.gguf", "--served-model-name", "coder", "gpt-4o", "claude-3"])
    assert args.served_model_name == ["coder", "gpt-4o", "claude-3"] and args.model_tag == "m.gguf"
    args.given_flags = set()
    assert configs_from(args, set())[1].served_model_name == ("coder", "gpt-4o", "claude-3")
    assert build_parser().parse_args(["serve"]).served_model_name is None
