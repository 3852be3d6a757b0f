"""A tiny random-weight Llama checkpoint, shared by the bench smoke tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))

from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_checkpoint("llama", directory)
    return directory


def run_cli(capsys, *argv: str) -> str:
    """Run `pagellm bench ...` in-process; return what it printed to stdout."""
    from pagellm.cli import main

    assert main(["bench", *argv]) == 0
    return capsys.readouterr().out
