"""bench accuracy's pieces on a tiny checkpoint: the paged forward it drives (eval/forward.py) and the distances
it reports."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from pagellm.bench import accuracy
from pagellm.eval.forward import pagellm_logits
from pagellm.loader.model_loader import load_model
from tests.eval import known_scores as known


def test_distances_of_a_model_to_itself_and_to_its_int4_copy(tiny_model_dir):
    tokens = torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    dense = load_model(str(tiny_model_dir), torch.float32, torch.device("cpu"), with_tokenizer=False).model
    whole = pagellm_logits(dense, tokens, torch.float32, chunk=len(tokens))
    chunked = pagellm_logits(dense, tokens, torch.float32, chunk=16)  # the cache carries the context
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)
    assert torch.equal(pagellm_logits(dense, tokens, torch.float32, chunk=16, first=40), chunked[40:])  # no row computed twice
    same = accuracy.distance(whole, whole, tokens)
    assert same["top1"] == 1.0 and abs(same["kl"]) < 1e-6
    nll = -whole.log_softmax(-1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None]).mean().item()
    assert math.isclose(same["ppl"], math.exp(nll), rel_tol=1e-5)
    int4 = load_model(str(tiny_model_dir), torch.float32, torch.device("cpu"), with_tokenizer=False,
                      quantization="int4").model
    int4_logits = pagellm_logits(int4, tokens, torch.float32)
    moved = accuracy.distance(whole, int4_logits, tokens)
    # the same figures summed here in fp64 from the rows that have a next token (the last has none)
    p, q = whole[:-1].double().log_softmax(-1), int4_logits[:-1].double().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    assert kl > 0 and moved["kl"] == pytest.approx(kl, rel=1e-4)  # fp32 logs: ~1e-5 off here
    assert moved["top1"] == (p.argmax(-1) == q.argmax(-1)).double().mean().item()
    nll = -q.gather(1, torch.tensor(tokens[1:])[:, None]).mean().item()
    assert moved["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)


def test_distance_of_a_known_distribution_is_the_hand_values():
    """distance(reference, logits, tokens): rows of every position, the first token only context."""
    reference, model = known.logits(known.REFERENCE, 2.0), known.logits(known.MODEL, -1.0)
    last = torch.zeros(1, 3)  # the last position has no next token: never scored, whatever it holds
    tokens = [1, *known.NEXT_TOKENS]
    scores = accuracy.distance(torch.cat([reference, last]), torch.cat([model, last + 9]), tokens)
    assert scores == pytest.approx({"top1": known.TOP1, "kl": known.KL_MEAN, "ppl": known.PPL}, rel=1e-6)
    assert abs(known.KL_MEAN - known.KL_REVERSED_MEAN) > 0.1  # so the direction shows
    swapped = accuracy.distance(torch.cat([model, last]), torch.cat([reference, last]), tokens)
    assert swapped == pytest.approx({"top1": known.TOP1, "kl": known.KL_REVERSED_MEAN, "ppl": known.REFERENCE_PPL},
                                    rel=1e-6)


def test_a_missing_llama_cpp_is_said_at_once_and_its_row_left_out(monkeypatch, tmp_path, capsys):
    """The default peers include llama.cpp; without llama-cpp-python the pagellm rows still come, no traceback."""
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"")
    logits = torch.randn(5, 11)
    monkeypatch.setattr(accuracy, "resolve_model_path", lambda model: gguf_file)
    monkeypatch.setattr(accuracy, "text_tokens", lambda path, text, positions: [1, 2, 3, 4, 5])
    monkeypatch.setattr(accuracy, "load_dense_reference", lambda path, kernels: None)
    monkeypatch.setattr(accuracy, "load_mode", lambda path, quantization, dtype, kernels: None)
    monkeypatch.setattr(accuracy, "pagellm_logits", lambda model, tokens, dtype, **kwargs: logits)
    monkeypatch.setattr(accuracy, "llama_cpp_available", lambda: "llama-cpp-python not importable (test)")
    args = argparse.Namespace(model=None, text="t.txt", positions=4, cpu_isa=None, dtype="float32",
                              quantization="auto", kv_cache_dtype="auto", peers="hf,llama.cpp", llama_threads=2)
    assert accuracy.main(args) == 0
    out = capsys.readouterr().out
    assert "llama.cpp: not run: llama-cpp-python not importable (test)" in out
    assert "| pagellm auto float32" in out and "(the file as stored)" not in out
