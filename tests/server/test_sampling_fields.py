"""Each sampling field of a completion request, proven at the server: every test checks the output against what the
field should do AND against what the server would produce without it (or with another field's value in its place),
so a field the server dropped, misrouted or swapped fails a test.

Outputs differ across CPUs (bfloat16 on AVX-512 BF16 hosts, float32 elsewhere) but are deterministic on one host
under a seed, so the tests take their cut-offs from the distributions the server reports, never from hard-coded
outputs, and check the margins they rely on.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pagellm.runner.sampler import apply_penalties
from pagellm.sampling_params import SamplingParams
from tests.server.test_openai_api import MODEL, concurrently

SEED = 1234
MAX_TOP = 20  # the server's MAX_LOGPROBS: the most top logprobs a request gets


def complete(http, **body) -> dict:
    response = http.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def texts(out: dict) -> list[str]:
    return [choice["text"] for choice in out["choices"]]


def first_tokens(out: dict) -> list[str]:
    return [choice["logprobs"]["tokens"][0] for choice in out["choices"]]


def test_top_k_1_and_a_temperature_near_0_give_the_greedy_text(http):
    """Greedy is defined from the raw logprobs: temperature 0 takes the most likely token at every step. top_k=1 and
    temperature 0.02 must give that text in every seeded child, while the same seeds at temperature 1 without
    top_k give something else: so a dropped temperature or top_k (sampling at the default temperature 1) fails."""
    # Many likely first tokens (the control's children disagree), and a clear best token at each greedy step
    base = dict(prompt="Name a colour:", max_tokens=4, n=8, seed=SEED)
    greedy, control, top_k, cold = concurrently(
        lambda: complete(http, **base, temperature=0, logprobs=2),
        lambda: complete(http, **base, temperature=1.0),
        lambda: complete(http, **base, temperature=1.0, top_k=1),
        lambda: complete(http, **base, temperature=0.02))
    for choice in greedy["choices"]:
        lp = choice["logprobs"]
        assert lp["tokens"] == [max(top, key=top.get) for top in lp["top_logprobs"]]  # argmax at every step
    assert len(set(texts(greedy))) == 1, texts(greedy)  # the seeds change nothing at temperature 0
    text = texts(greedy)[0]
    # At temperature 0.02 a runner-up `gap` below the best is exp(-gap / 0.02) times as likely: < 1e-8 here.
    gaps = [sorted(top.values())[-1] - sorted(top.values())[-2] for top in greedy["choices"][0]["logprobs"][
        "top_logprobs"]]
    assert min(gaps) > 0.4, f"a near-tie on the greedy path makes temperature 0.02 a coin toss: {gaps}"
    assert texts(top_k) == [text] * 8
    assert texts(cold) == [text] * 8
    # the control can tell: 8 draws at temperature 1 all give the greedy text with probability P(text) ** 8
    log_p_text = sum(greedy["choices"][0]["logprobs"]["token_logprobs"])
    assert 8 * log_p_text < math.log(1e-4), f"the greedy text is too likely (log p {log_p_text:.2f}) to tell"
    assert any(t != text for t in texts(control)), texts(control)


def kept_by_a_cut(top: dict[str, float]) -> tuple[set[str], float, float]:
    """From a position's top logprobs: the k most likely tokens (k at the clearest gap in probability), a top_p and
    a min_p that each keep exactly those, halfway (in mass, in ratio) between keeping k - 1 and k + 1 tokens."""
    ranked = sorted(top, key=top.get, reverse=True)
    probs = [math.exp(top[token]) for token in ranked]
    k = max(range(2, 8), key=lambda k: probs[k - 1] / probs[k])
    # margins the draws rely on: the cut sits in a clear gap; outside it is mass enough that some of the control's
    # CONTROL_DRAWS land there ((1 - 0.3) ** 32 < 1e-4); each kept token is likely enough to be among the DRAWS
    # ((1 - 0.2) ** 48 < 1e-4)
    assert probs[k - 1] / probs[k] > 1.5 and 1 - sum(probs[:k]) > 0.3, probs
    assert probs[k - 1] / sum(probs[:k]) > 0.2, probs
    top_p = sum(probs[: k - 1]) + probs[k - 1] / 2  # reached by the k-th token, not before it
    min_p = math.sqrt(probs[k - 1] * probs[k]) / probs[0]  # p_k / p_1 > min_p > p_(k+1) / p_1
    return set(ranked[:k]), top_p, min_p


# Seeded one-token draws per request (its n children): the server's sampler costs ~50 ms a draw on 2 cores
DRAWS, CONTROL_DRAWS = 48, 32


def test_top_p_and_min_p_keep_exactly_the_tokens_above_their_cut(http):
    """Seeded one-token draws under a top_p, and under a min_p, each set to keep exactly the k most likely tokens,
    draw each of those and nothing else; the same seeds without the field draw outside them (so a dropped field
    fails), and a field misrouted to a cut that keeps more or fewer tokens fails too."""
    base = dict(prompt="Pick a number:", max_tokens=1, seed=SEED, temperature=1.0)
    # temperature 1: the control samples the raw distribution, the one top_p and min_p cut
    control = complete(http, **base, n=CONTROL_DRAWS, logprobs=MAX_TOP)
    # the top 20, and the child's own draw when it is not among them
    top = control["choices"][0]["logprobs"]["top_logprobs"][0]
    assert len(top) >= MAX_TOP  # no two of the top tokens decode to the same text
    kept, top_p, min_p = kept_by_a_cut(top)
    by_top_p, by_min_p = concurrently(lambda: complete(http, **base, n=DRAWS, top_p=top_p, logprobs=0),
                                      lambda: complete(http, **base, n=DRAWS, min_p=min_p, logprobs=0))
    assert set(first_tokens(by_top_p)) == kept, (top_p, kept)
    assert set(first_tokens(by_min_p)) == kept, (min_p, kept)
    assert not set(first_tokens(control)) <= kept, kept


def penalized(lp: dict, presence: float, frequency: float) -> list[tuple[float, float]]:
    """Per generated step, from pagellm's apply_penalties on the step's raw top logprobs: how far the best penalized
    score is above that of the token the server chose (0 where the server's token ranks first), and how far the
    chosen token's score is above the lowest raw top logprob.

    Presence and frequency subtract per-token amounts from the logits, so the raw logprobs (the logits shifted by
    one constant) give the same decision. Tokens are told apart by their text, over a small vocabulary of their own."""
    vocab = {token: i for i, token in enumerate(sorted({t for top in lp["top_logprobs"] for t in top}))}
    params = SamplingParams(temperature=0, presence_penalty=presence, frequency_penalty=frequency)
    steps = []
    for step, (token, top) in enumerate(zip(lp["tokens"], lp["top_logprobs"])):
        assert len(top) == MAX_TOP and token in top  # distinct texts; the chosen token among them
        logits = torch.full((1, len(vocab)), float("-inf"))
        logits[0, [vocab[t] for t in top]] = torch.tensor(list(top.values()))
        row = SimpleNamespace(sampling_params=params, prompt_token_ids=[],
                              output_token_ids=[vocab[t] for t in lp["tokens"][:step]])
        scores = apply_penalties(logits, [row])[0]
        chosen = scores[vocab[token]].item()
        steps.append((scores.max().item() - chosen, chosen - min(top.values())))
    return steps


def test_presence_and_frequency_penalties_choose_as_the_formula_says(http):
    """A greedy run under both penalties (over output tokens only): at every step the server's token is the one
    apply_penalties ranks first on the server's own raw logprobs. Dropping either penalty, swapping their values,
    or dropping both would rank another token first at some step: then the server's output would have differed."""
    presence, frequency = 1.5, 0.5  # distinct: a swap changes the penalty of every token seen twice or more
    out = complete(http, prompt="red, green, blue, red, green,", max_tokens=16, temperature=0,
                   presence_penalty=presence, frequency_penalty=frequency, logprobs=MAX_TOP)
    lp = out["choices"][0]["logprobs"]
    for above_chosen, above_floor in penalized(lp, presence, frequency):
        assert above_chosen < 1e-4  # ranked first, up to fp32 rounding between logits and logprobs
        # penalties only lower scores: no token outside the top 20 (raw logprob <= the 20th) could rank above it
        assert above_floor >= 0
    for alternative in ((0.0, frequency), (presence, 0.0), (frequency, presence), (0.0, 0.0)):
        assert max(above for above, _ in penalized(lp, *alternative)) > 0.1, alternative


@pytest.fixture(scope="module")
def local_model():
    """The server's model in this process, as `pagellm serve` loads it: default kernel level, "auto" dtypes (for
    a GGUF's blocks: float32 with fp16 K/V) and GGUF quantization."""
    from pagellm.eval.forward import load_mode, mode_backend
    from pagellm.loader.default_model import default_model_path

    backend = mode_backend(default_model_path())  # as the engine's: "auto" dtypes follow the level and the file
    dtype = backend.compute_dtype
    return load_mode(default_model_path(), "auto", dtype), dtype, backend.kv_cache_dtype, backend.narrow_dtype


def test_repetition_penalty_divides_the_logits_of_prompt_tokens(http, local_model):
    """The first token after a prompt that invites a repeat, at two repetition penalties either side of the one where
    the repeated token (a prompt token) falls below the best token not in the prompt: the server's first token is
    what apply_penalties picks from the real logits at each. Dropping or misrouting the field (presence and frequency
    see no output yet) keeps the greedy token at the higher one; a stronger penalty (r squared) flips the lower."""
    from pagellm.eval.forward import pagellm_logits

    model, dtype, kv_dtype, narrow = local_model
    ids = http.post("/tokenize", json={"prompt": "a b a b a b a"}).json()["tokens"]
    logits = pagellm_logits(model, ids, dtype, first=len(ids) - 1, kv_cache_dtype=kv_dtype, narrow=narrow)[0]
    greedy = complete(http, prompt=ids, max_tokens=1, temperature=0, logprobs=MAX_TOP)["choices"][0]["logprobs"]
    # the same distribution as the server's (same prefill): by value, within what a different CPU order could change
    ours = torch.log_softmax(logits, -1).topk(MAX_TOP).values
    assert torch.allclose(ours, torch.tensor(sorted(greedy["top_logprobs"][0].values(), reverse=True)), atol=0.02)
    best = int(logits.argmax())
    in_prompt = torch.zeros_like(logits, dtype=torch.bool)
    in_prompt[ids] = True
    rival = float(logits.masked_fill(in_prompt, float("-inf")).max())
    assert best in ids and logits[best] > rival > 0, "the prompt must invite a repeat"
    flip = float(logits[best]) / rival  # the penalty at which the repeated token ties with its rival
    low, high = flip / 1.1, flip * 1.1
    assert low ** 2 > flip  # r squared at the lower penalty would flip the choice

    def expected(penalty: float) -> int:
        row = SimpleNamespace(sampling_params=SamplingParams(temperature=0, repetition_penalty=penalty),
                              prompt_token_ids=ids, output_token_ids=[])
        top = apply_penalties(logits[None], [row])[0].topk(2)
        assert top.values[0] - top.values[1] > 0.5  # far from a tie, whatever CPU computed the server's logits
        return int(top.indices[0])

    assert expected(low) == best != expected(high)
    outs = concurrently(*[lambda p=p: complete(http, prompt=ids, max_tokens=1, temperature=0, repetition_penalty=p)
                          for p in (low, high)])
    decoded = [http.post("/detokenize", json={"tokens": [expected(p)]}).json()["prompt"] for p in (low, high)]
    assert texts(outs[0]) + texts(outs[1]) == decoded
    assert decoded[0] == greedy["tokens"][0] != decoded[1]
