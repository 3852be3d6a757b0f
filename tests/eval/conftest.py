"""A tiny random-weight Llama checkpoint with a character-level tokenizer, so a text file can be evaluated."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.tiny_checkpoints import write_tiny_checkpoint


def write_char_tokenizer(directory: Path) -> None:
    """One token per character (printable ASCII and newline), BOS first: ids stay under the tiny vocabulary."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]  # <s> is id 1, the checkpoint's bos_token_id
    vocab = {token: i for i, token in enumerate(specials + ["\n"] + [chr(c) for c in range(32, 127)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(directory)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(checkpoint directory with its tokenizer, the HF model it holds)."""
    directory = tmp_path_factory.mktemp("tiny-llama-chars")
    hf_model = write_tiny_checkpoint("llama", directory)
    write_char_tokenizer(directory)
    return directory, hf_model
