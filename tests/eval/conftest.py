"""A tiny random-weight Llama checkpoint with a character-level tokenizer, so a text file can be evaluated."""

from __future__ import annotations

import pytest

from tests.models.tiny_checkpoints import write_char_tokenizer, write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(checkpoint directory with its tokenizer, the HF model it holds)."""
    directory = tmp_path_factory.mktemp("tiny-llama-chars")
    hf_model = write_tiny_checkpoint("llama", directory)
    write_char_tokenizer(directory)
    return directory, hf_model
