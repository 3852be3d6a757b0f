"""Running `pagellm bench ...` in process, for the bench smoke tests."""

from __future__ import annotations

from pagellm.cli import main


def run_cli(capsys, *argv: str) -> str:
    """Run `pagellm bench ...` in-process; return what it printed to stdout."""
    assert main(["bench", *argv]) == 0
    return capsys.readouterr().out
