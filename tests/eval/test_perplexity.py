"""`pagellm eval perplexity` on a tiny checkpoint: llama-perplexity's windows and figures, checked against
the same windows scored independently with HF transformers."""

from __future__ import annotations

import math
import re

import pytest
import torch
from transformers import AutoTokenizer

from pagellm.cli import main
from pagellm.eval import perplexity
from pagellm.eval.forward import load_mode, tokenize_text

CTX = 32
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity.\n") * 2  # 330 characters


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "tale.txt"
    path.write_text(TEXT)
    return path


def hf_window_nll(directory, hf_model) -> list[float]:
    """llama-perplexity's method written out: whole windows, BOS first, the second half scored."""
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    bos, ids = tokenizer.bos_token_id, tokenizer.encode(TEXT)
    assert ids[0] == bos and len(ids) == len(TEXT) + 1  # one token per character, after BOS
    nll = []
    for i in range(len(ids) // CTX):
        window = [bos] + ids[i * CTX + 1 : (i + 1) * CTX]
        with torch.inference_mode():
            logp = hf_model(torch.tensor([window])).logits[0].float().log_softmax(-1)
        nll += [-logp[p, window[p + 1]].item() for p in range(CTX // 2, CTX - 1)]
    return nll


def run(capsys, *argv: str) -> str:
    """The command's stdout; fp32 and dense unless argv says otherwise (argparse: the last flag wins)."""
    assert main(["eval", "perplexity", "--dtype", "float32", "--quantization", "none", *argv]) == 0
    return capsys.readouterr().out


def test_perplexity_is_exp_mean_nll_of_hf_on_the_same_windows(tiny_llama, text_file, capsys):
    directory, hf_model = tiny_llama
    nll = hf_window_nll(directory, hf_model)
    assert len(nll) == (331 // CTX) * (CTX - 1 - CTX // 2)  # 10 windows of 15 scored positions
    expected = math.exp(sum(nll) / len(nll))
    mean, mean_sq = sum(nll) / len(nll), sum(x * x for x in nll) / len(nll)
    expected_error = expected * math.sqrt((mean_sq - mean * mean) / (len(nll) - 1))

    tokens, bos = tokenize_text(directory, str(text_file))
    chunks = perplexity.windows(tokens, CTX, bos)
    model = load_mode(directory, "none", torch.float32)
    summary = perplexity.summarize(perplexity.concat(list(perplexity.score_windows(model, torch.float32, chunks))))
    assert summary.positions == len(nll)
    assert summary.ppl == pytest.approx(expected, rel=1e-5)
    assert summary.ppl_error == pytest.approx(expected_error, rel=1e-3)

    out = run(capsys, "--model", str(directory), "--text", str(text_file), "--ctx", str(CTX), "--kl-base", "none")
    ppl, error = map(float, re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out).groups())
    assert ppl == pytest.approx(expected, abs=1e-4) and error == pytest.approx(expected_error, abs=1e-5)
    assert re.findall(r"\[(\d+)\]", out) == [str(i) for i in range(1, 11)]
    assert "KL" not in out


def test_kl_against_the_dense_model_and_a_window_limit(tiny_llama, text_file, capsys):
    directory, _ = tiny_llama
    common = ("--model", str(directory), "--text", str(text_file), "--ctx", str(CTX), "--chunks", "3")
    dense = run(capsys, *common)  # the mode is the reference itself
    assert "mean 0.000000 +/- 0.000000; top-1 agreement 100.000 +/- 0.000 %" in dense
    assert "(45 positions)" in dense and re.findall(r"\[(\d+)\]", dense) == ["1", "2", "3"]
    int4 = run(capsys, *common, "--quantization", "int4")
    kl, top1 = map(float, re.search(r"mean ([\d.]+) .*agreement ([\d.]+)", int4).groups())
    assert kl > 0 and 0 <= top1 <= 100


@pytest.mark.parametrize("argv,message", [
    (("--ctx", "2"), "--ctx must be >= 4"),
    (("--ctx", "400"), "fewer than one window"),
    (("--ctx", "300"), "longer than the model's context"),
])
def test_bad_settings_are_named(tiny_llama, text_file, capsys, argv, message):
    directory, _ = tiny_llama
    assert main(["eval", "perplexity", "--model", str(directory), "--text", str(text_file), *argv]) == 2
    assert message in capsys.readouterr().err
