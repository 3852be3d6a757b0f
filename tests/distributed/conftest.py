"""Tiny checkpoints shared by the distributed tests (each test starts its own worker processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.tiny_checkpoints import HYBRID_CONFIGS, write_hybrid_checkpoint, write_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(family) -> path of that family's tiny random-weight HF checkpoint (written once)."""
    written: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in written:
            directory = tmp_path_factory.mktemp(family.replace(".", "_"))
            writer = write_hybrid_checkpoint if family in HYBRID_CONFIGS else write_tiny_checkpoint
            writer(family, directory)
            written[family] = directory
        return written[family]

    return get
