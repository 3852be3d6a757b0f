"""GGUF loader on tiny files written with gguf.GGUFWriter: config, names, dequantization, conversions."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.gguf.dequant import dequantize as hf_torch_dequantize
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagellm.layers.rotary import compute_rope
from pagellm.loader import gguf_file, model_configs
from pagellm.loader.gguf import iter_gguf_weights, load_gguf_config, read_gguf_header, unpermute_qk_rows
from pagellm.loader.model_loader import load_model
from tests.loader.gguf_builders import (TinyDims, convert_llama_checkpoint, llama_cpp_permute,
                                        llama_cpp_rope_factors, write_tiny_gguf)
from tests.models.hf_reference import hf_greedy, hf_logits, random_tokens
from tests.models.paged_harness import PagedHarness, greedy_generate
from tests.models.tiny_checkpoints import TINY_CONFIGS, write_tiny_checkpoint

# One tensor per storage type the loader must handle. K-quants need rows of 256 values, which
# only ffn_down has (intermediate = 256); the gguf package cannot quantize them, so the builder
# writes random blocks with sane f16 scales (see random_k_quant_blocks).
MIXED_TYPES = {
    "token_embd.weight": T.BF16,
    "output.weight": T.F16,
    "blk.0.attn_q.weight": T.Q8_0,
    "blk.0.attn_k.weight": T.Q5_0,
    "blk.0.attn_v.weight": T.F16,
    "blk.0.ffn_gate.weight": T.Q8_0,
    "blk.0.ffn_down.weight": T.Q4_K,
    "blk.1.ffn_down.weight": T.Q6_K,
    "blk.1.attn_output.weight": T.BF16,
    # blk.1.attn_q / attn_k stay F32: they must come back exactly as the HF weights
}


def load_all(path, config=None, dequantize_on=None):
    config = config or load_gguf_config(path)
    return dict(iter_gguf_weights(path, config, progress=False, dequantize_on=dequantize_on))


@pytest.mark.parametrize("dequantize_on", [None, torch.device("cpu")], ids=["numpy", "planes"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_weights_match_the_dequantized_stored_data(tmp_path, arch, dequantize_on):
    """numpy's dequantization on the host, or (dequantize_on: what a GPU load does) the blocks as planes on the
    device, dequantized there: the same values bit for bit, llama's q/k rows unpermuted either way."""
    tiny = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, types=MIXED_TYPES)
    got = load_all(tiny.path, dequantize_on=dequantize_on)
    assert sorted(got) == sorted(tiny.expected)
    for name, weight in got.items():
        assert weight.dtype == torch.float32, name
        torch.testing.assert_close(weight, torch.from_numpy(tiny.expected[name]), rtol=0, atol=0, msg=name)
    assert set(tiny.types.values()) >= {T.F32, T.F16, T.BF16, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K}


def test_llama_qk_permutation_is_undone_exactly(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "llama.gguf", "llama", types=MIXED_TYPES)
    got = load_all(tiny.path)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.equal(got[name], torch.from_numpy(tiny.original[name]))  # stored as F32
        assert not torch.equal(got[name], torch.from_numpy(llama_cpp_permute(tiny.original[name], 2)))


@pytest.mark.parametrize("n_heads,head_dim,in_features", [(4, 16, 64), (2, 16, 64), (1, 256, 640), (8, 8, 3)])
def test_unpermute_inverts_llama_cpp_permute(n_heads, head_dim, in_features):
    hf_q = torch.randn(n_heads * head_dim, in_features)
    stored = torch.from_numpy(llama_cpp_permute(hf_q.numpy(), n_heads))
    assert not torch.equal(stored, hf_q)
    assert torch.equal(unpermute_qk_rows(stored, n_heads), hf_q)


def test_non_llama_families_are_not_permuted(tmp_path):
    for arch in ("qwen3", "gemma3"):
        tiny = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch)
        got = load_all(tiny.path)
        name = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(got[name], torch.from_numpy(tiny.original[name]))


def test_gemma3_norms_lose_llama_cpp_plus_one(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "gemma3.gguf", "gemma3")
    got = load_all(tiny.path)
    norms = [n for n in got if "norm" in n]
    assert len(norms) == 1 + 2 * 6  # final norm; per layer 4 block norms + q_norm + k_norm
    for name in norms:
        torch.testing.assert_close(got[name], torch.from_numpy(tiny.original[name]), rtol=0, atol=1e-6)


def test_gguf_package_dequant_agrees_with_transformers_torch_dequant(tmp_path):
    """The loader's dequantizer (gguf.quants) against an independent one (transformers' torch one)."""
    tiny = write_tiny_gguf(tmp_path / "llama.gguf", "llama", types=MIXED_TYPES)
    checked = set()
    for tensor in read_gguf_header(tiny.path).tensors:
        if tensor.ggml_type in (T.Q8_0, T.Q4_K, T.Q6_K):
            ours = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.ggml_type))
            raw = torch.from_numpy(np.array(tensor.data)).reshape(-1)
            reference = hf_torch_dequantize(raw, int(tensor.ggml_type)).reshape(tensor.shape)
            torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7, msg=tensor.name)
            checked.add(tensor.ggml_type)
    assert checked == {T.Q8_0, T.Q4_K, T.Q6_K}


def test_llama_config_fields_as_written(tmp_path):
    dims = TinyDims(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, context=512, rope_base=5e5, rms_eps=1e-5)
    tiny = write_tiny_gguf(tmp_path / "llama.gguf", "llama", dims=dims)
    config = load_gguf_config(tiny.path)
    assert type(config) is model_configs.LlamaConfig and config.architectures == ("LlamaForCausalLM",)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (64, 64, 3)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    assert config.intermediate_size == 256 and config.max_position_embeddings == 512
    assert config.rms_norm_eps == 1e-5
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}
    assert config.tie_word_embeddings is False
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_tied_embeddings_when_there_is_no_output_tensor(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "qwen3.gguf", "qwen3", tie_embeddings=True)
    config = load_gguf_config(tiny.path)
    assert config.tie_word_embeddings is True
    assert "lm_head.weight" not in load_all(tiny.path, config)


@pytest.mark.parametrize(
    "arch,cls,hf_arch", [("qwen2", model_configs.Qwen2Config, "Qwen2ForCausalLM"),
                         ("qwen3", model_configs.Qwen3Config, "Qwen3ForCausalLM")]
)
def test_qwen_configs(tmp_path, arch, cls, hf_arch):
    # head_dim differs from hidden / heads (as in Qwen3-0.6B): it must come from key_length
    dims = TinyDims(hidden=64, n_heads=2, n_kv_heads=1, head_dim=48)
    config = load_gguf_config(write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, dims=dims).path)
    assert type(config) is cls and config.architectures == (hf_arch,)
    assert config.head_dim == 48 and config.num_key_value_heads == 1


def test_rope_scaling(tmp_path):
    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    def yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(2.0)
        w.add_rope_scaling_orig_ctx_len(64)

    config = load_gguf_config(write_tiny_gguf(tmp_path / "a.gguf", extra_metadata=linear).path)
    assert config.rope_parameters == {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}
    config = load_gguf_config(write_tiny_gguf(tmp_path / "b.gguf", extra_metadata=yarn).path)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 2.0
    assert config.rope_parameters["original_max_position_embeddings"] == 64


@pytest.mark.parametrize("stored", [T.F32, T.F16])
def test_rope_freqs_become_freq_factors_that_divide_the_frequencies(tmp_path, stored):
    factors = np.array([1.0, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 8.0], dtype=np.float32)  # head_dim 16: 8 frequencies
    raw = factors.astype(np.float16) if stored == T.F16 else factors
    path = write_tiny_gguf(tmp_path / "r.gguf", extra_tensors={"rope_freqs.weight": raw}).path
    config = load_gguf_config(path)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e4, "freq_factors": factors.tolist()}
    plain, _ = compute_rope(16, {"rope_type": "default", "rope_theta": 1e4}, 128)
    ours, _ = compute_rope(config.head_dim, config.rope_parameters, config.max_position_embeddings)
    assert torch.equal(ours, plain / torch.from_numpy(factors))


# (head_dim, rope_theta, factor, original_max_position_embeddings): Llama 3.1 8B, Llama 3.2 1B, the tiny model below
LLAMA3_ROPES = [(128, 5e5, 8.0, 8192), (64, 5e5, 32.0, 8192), (16, 1e4, 8.0, 64)]


@pytest.mark.parametrize("head_dim,theta,factor,original", LLAMA3_ROPES)
def test_llama_cpp_rope_factors_give_hf_llama3_frequencies(head_dim, theta, factor, original):
    """inv_freq / (llama.cpp's factors) against HF's own llama3 inv_freq: equal within fp32 rounding."""
    rope = dict(rope_type="llama3", rope_theta=theta, factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=original)
    hf_config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_parameters=rope,
                            original_max_position_embeddings=original)  # the top-level copy the converter reads
    factors = llama_cpp_rope_factors(hf_config.to_dict())
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours, _ = compute_rope(head_dim, {"rope_type": "default", "rope_theta": theta, "freq_factors": factors}, 131072)
    torch.testing.assert_close(ours, theirs, rtol=4 * 2**-24, atol=0)
    assert (factors == 1).any() and (factors == factor).any() and ((factors > 1) & (factors < factor)).any()


def _llama31_config() -> LlamaConfig:
    """tiny_checkpoints' llama3-rope model (original context 64, so kept, divided and interpolated frequencies all
    occur at head_dim 16), as Llama 3.x has it: no attention bias. Its original_max_position_embeddings is also
    set at the top level, where llama.cpp's converter reads it (8192 when absent)."""
    config = TINY_CONFIGS["llama3-rope-tied"]()
    config.attention_bias = False
    config.original_max_position_embeddings = config.rope_parameters["original_max_position_embeddings"]
    return config


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    """(HF model, the GGUF converted from its checkpoint as llama.cpp converts it, the rope factors written)."""
    directory = tmp_path_factory.mktemp("llama31")
    hf_model = write_tiny_checkpoint("llama3-rope-tied", directory / "hf", config=_llama31_config(), redraw=True)
    factors = convert_llama_checkpoint(directory / "hf", directory / "model.gguf")
    return hf_model, directory / "model.gguf", factors


def test_llama31_gguf_rope_frequencies_are_hf_llama3(llama31):
    hf_model, path, factors = llama31
    config = load_gguf_config(path)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e4, "freq_factors": factors.tolist()}
    ours, _ = compute_rope(config.head_dim, config.rope_parameters, config.max_position_embeddings)
    torch.testing.assert_close(ours, hf_model.model.rotary_emb.inv_freq, rtol=4 * 2**-24, atol=0)


def test_llama31_gguf_logits_and_greedy_tokens_match_hf(llama31):
    hf_model, path, _ = llama31
    model = load_model(str(path), torch.float32, torch.device("cpu"), with_tokenizer=False).model
    prompt = random_tokens(48, seed=0)  # positions 0..63, past the original context (64) with the generated tokens
    expected_logits = hf_logits(hf_model, prompt)
    torch.testing.assert_close(PagedHarness(model).prefill("a", prompt), expected_logits, atol=1e-4, rtol=1e-4)
    expected = hf_greedy(hf_model, prompt, 16)
    assert greedy_generate(model, prompt, max_new_tokens=16) == expected
    # guards the test: without the llama3 scaling the same weights give other logits and other tokens
    unscaled = LlamaForCausalLM(_unscaled(hf_model.config)).eval()
    unscaled.load_state_dict(hf_model.state_dict())
    assert (hf_logits(unscaled, prompt) - expected_logits).abs().max() > 0.1
    assert hf_greedy(unscaled, prompt, 16) != expected and len(set(expected)) > 2


def _unscaled(config: LlamaConfig) -> LlamaConfig:
    plain = LlamaConfig.from_dict(config.to_dict())
    plain.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    plain._attn_implementation = "eager"
    return plain


def test_gemma3_config_follows_llama_cpp(tmp_path):
    dims = TinyDims(n_layers=7, head_dim=32, rope_base=1e6)
    config = load_gguf_config(write_tiny_gguf(tmp_path / "g.gguf", "gemma3", dims=dims).path)
    assert type(config) is model_configs.Gemma3TextConfig and config.architectures == ("Gemma3ForCausalLM",)
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert config.rope_parameters == {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},  # llama.cpp's fixed local base
    }
    assert config.sliding_window == 32 and config.query_pre_attn_scalar == 32  # = key_length
    assert config.head_dim == 32 and config.tie_word_embeddings is False


def test_gemma3_explicit_pattern_and_local_base(tmp_path):
    def extra(w):
        w.add_sliding_window_pattern([True, False, True])
        w.add_rope_freq_base_swa(2e4)

    tiny = write_tiny_gguf(tmp_path / "g.gguf", "gemma3", TinyDims(n_layers=3), extra_metadata=extra)
    config = load_gguf_config(tiny.path)
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 2e4


def test_header_matches_gguf_reader(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "llama.gguf", "llama", types=MIXED_TYPES)
    ours, reader = read_gguf_header(tiny.path), GGUFReader(tiny.path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in ours.array_lengths:
            assert ours.array_lengths[key] == len(field.data), key
            if key in ours.metadata:  # numeric arrays
                np.testing.assert_allclose(ours.metadata[key], field.contents(), rtol=1e-7, err_msg=key)
                np.testing.assert_array_equal(ours.numbers(key), ours.metadata[key], err_msg=key)
        elif isinstance(field.contents(), float):
            assert ours.metadata[key] == pytest.approx(field.contents(), rel=1e-7), key
        else:
            assert ours.metadata[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors):
        assert mine.ggml_type == theirs.tensor_type
        assert mine.shape == tuple(reversed(theirs.shape.tolist()))
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name


@pytest.fixture(params=["compiled", "python"])
def string_walk(request, monkeypatch):
    """The header reader's walk over string arrays: C++ (where there is a compiler), or its Python fallback."""
    if request.param == "python":
        monkeypatch.setattr(gguf_file.native, "load", lambda *args, **kwargs: None)
    return request.param


def test_string_arrays_walk_to_the_reader_s_contents(tmp_path, string_walk):
    tiny = write_tiny_gguf(tmp_path / "llama.gguf", "llama")
    ours, reader = read_gguf_header(tiny.path), GGUFReader(tiny.path)
    assert ours.string_arrays  # the tokens at least
    for key in ours.string_arrays:
        assert ours.strings(key) == reader.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]  # the table after them


@pytest.mark.parametrize("damage", ["truncated", "huge length"])
def test_string_array_past_the_end_is_an_error_naming_the_key(tmp_path, string_walk, damage):
    tiny = write_tiny_gguf(tmp_path / "llama.gguf", "llama")
    first = read_gguf_header(tiny.path).string_arrays["tokenizer.ggml.tokens"]
    data = bytearray(tiny.path.read_bytes())
    if damage == "truncated":
        data = data[: first + 20]
    else:
        data[first : first + 8] = (1 << 62).to_bytes(8, "little")
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens.*past the end"):
        read_gguf_header(path)


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "x.gguf", "gpt2").path
    with pytest.raises(ValueError, match=r"'gpt2'.*supported.*gemma3.*llama.*qwen2.*qwen3"):
        load_gguf_config(path)


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_config(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        next(iter_gguf_weights(missing, model_configs.LlamaConfig()))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf_config(path)


def test_unsupported_quant_type_names_tensor_and_type(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "q.gguf", "llama")
    # rewrite with attn_v as Q8_1 (valid block size, but the gguf package has no dequantizer for it)
    raw = np.zeros((32, 64 // 32 * 40), dtype=np.uint8)
    path = _rewrite_tensor(tmp_path, tiny, "blk.0.attn_v.weight", raw, T.Q8_1)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_v\.weight.*Q8_1"):
        next(iter_gguf_weights(path, load_gguf_config(path)))


def test_tensor_without_hf_parameter_is_an_error(tmp_path):
    extra = {"blk.0.mystery.weight": np.zeros(4, dtype=np.float32)}
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", extra_tensors=extra).path
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        next(iter_gguf_weights(path, load_gguf_config(path)))


def _rewrite_tensor(tmp_path, tiny, name, raw, qtype):
    """A copy of a tiny file with one tensor replaced by raw blocks of another type."""
    reader = GGUFReader(tiny.path)
    out = tmp_path / "rewritten.gguf"
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name == name:
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_released_tensor_pages_read_back_the_same(tmp_path):
    """The loader drops each tensor's file pages from the resident set once consumed (GGUFTensor.release); a view
    read afterwards faults them back in from the file: the same bytes."""
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", types={"blk.0.ffn_down.weight": T.Q8_0})
    header = read_gguf_header(tiny.path)
    for tensor in header.tensors:
        before = np.array(tensor.data, copy=True)
        tensor.release()
        assert np.array_equal(np.asarray(tensor.data), before), tensor.name
    weights = dict(iter_gguf_weights(tiny.path, load_gguf_config(tiny.path)))  # releases as it goes
    assert all(torch.isfinite(w).all() for w in weights.values())
