"""A tiny random-weight Llama checkpoint, shared by the bench smoke tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_checkpoint("llama", directory)
    return directory

