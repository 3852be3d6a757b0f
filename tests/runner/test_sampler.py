"""Sampler behaviour a user relies on, on CPU.

Distribution tests feed the same logits in many rows at once and count tokens, so one call gives
thousands of samples; probabilities are chosen well away from the top-p / min-p boundaries.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pagellm.kernels.build import native
from pagellm.runner.sampler import Sampler, SamplerOutput, apply_penalties
from pagellm.runner.token_draws import sample_inverse_cdf
from pagellm.sampling_params import SamplingParams


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    stop_ids: tuple[int, ...] = ()
    grammar: object | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def __post_init__(self):
        # As the engine does: a generator iff the request has a seed.
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)


def rows_of(n: int, **params) -> list[Row]:
    return [Row(SamplingParams(**params)) for _ in range(n)]


def logits_for(probs: list[float], batch: int) -> torch.Tensor:
    """[batch, V] logits whose softmax is `probs` in every row."""
    return torch.tensor(probs).log().expand(batch, -1).contiguous()


def token_counts(out: SamplerOutput) -> Counter:
    return Counter(out.token_ids.tolist())


# ---- greedy -------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler(seed=0)(logits, rows_of(8, temperature=0.0))
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


class _RecordOps(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


# The torch ops each greedy path runs ("__get__", attribute access, left out): torch's is one "argmax"; the native
# argmax (kernels/cpu/logits.py) only reads the tensor's layout and allocates its output.
GREEDY_OPS = {"torch": {"argmax"}, "native": {"contiguous", "dim", "is_contiguous", "numel", "empty", "data_ptr"}}


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_all_greedy_batch_does_only_an_argmax(kernels):
    logits = torch.randn(4, 100)
    level = native.default_level() if kernels == "native" else None
    if level is None and kernels == "native":
        pytest.skip("native kernels are off in this run; the torch case covers it")
    sampler = Sampler(seed=0, kernel_level=level)
    with _RecordOps() as ops:
        out = sampler(logits, rows_of(4, temperature=0.0, top_k=5, top_p=0.5))
    expected = GREEDY_OPS[kernels] if kernels == "torch" or native.compiler() is not None else GREEDY_OPS["torch"]
    assert {n for n in ops.names if n != "__get__"} == expected
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_full_feature_batch_never_reads_device_values_back():
    """No .item(), .tolist(), bool(tensor) etc. inside the sampler: each would be a host sync on a GPU."""
    syncing = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"}
    rows = [
        Row(SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2), (1, 2), [3]),
        Row(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3, logprobs=0), (4,), [5, 5]),
        Row(SamplingParams(temperature=1.2, presence_penalty=0.5, frequency_penalty=0.2), (6,), [7]),
        Row(SamplingParams(temperature=1.0, top_k=3)),
    ]
    with _RecordOps() as ops:
        Sampler(seed=0)(torch.randn(4, 64), rows)
    assert not syncing & set(ops.names)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_feature_batch_does_not_sync_on_cuda():
    """Also catches blocking host-to-device copies, which wait for all queued GPU work."""
    device = torch.device("cuda")
    rows = [
        Row(SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2), (1, 2), [3]),
        Row(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs=0), (4,), [5, 5]),
        Row(SamplingParams(temperature=1.2, presence_penalty=0.5, frequency_penalty=0.2, seed=3), (6,), [7]),
    ]
    rows[2].generator = torch.Generator(device=device).manual_seed(3)
    logits = torch.randn(3, 64, device=device)
    sampler = Sampler(seed=0)
    sampler(logits, rows)  # first call may allocate pinned memory and the generator
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.device.type == "cuda"
    assert out.token_ids[0].item() == logits[0].argmax().item()


def test_input_logits_are_not_modified():
    logits = torch.randn(3, 40)
    before = logits.clone()
    rows = [
        Row(SamplingParams(temperature=0.8, top_k=4, top_p=0.8, min_p=0.1, logprobs=3)),
        Row(SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0), (1, 2), [3, 4]),
        Row(SamplingParams(temperature=1.0, top_k=2)),
    ]
    Sampler(seed=0)(logits, rows)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 50.0])
def test_top_k_1_equals_greedy_at_any_temperature(temperature):
    logits = torch.randn(256, 30, generator=torch.Generator().manual_seed(1))
    out = Sampler(seed=0)(logits, rows_of(256, temperature=temperature, top_k=1))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


# ---- filtering: top-k, top-p, min-p ------------------------------------------------------------

PROBS = [0.4, 0.3, 0.2, 0.1]
DRAWS = 20_000


@pytest.mark.parametrize(
    "params, kept",
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.35}, {0}),  # the top token alone already reaches 0.35
        ({"top_p": 0.6}, {0, 1}),  # 0.4 < 0.6, 0.4 + 0.3 >= 0.6
        ({"top_p": 0.8}, {0, 1, 2}),
        ({"min_p": 0.3}, {0, 1, 2}),  # threshold 0.3 * 0.4 = 0.12
        ({"min_p": 0.6}, {0, 1}),  # threshold 0.24
        ({"min_p": 0.9}, {0}),  # threshold 0.36
        ({"top_k": 3, "top_p": 0.6}, {0, 1}),
        ({"top_k": 2, "min_p": 0.3}, {0, 1}),
        ({"top_p": 0.8, "min_p": 0.6}, {0, 1}),
    ],
)
def test_filters_keep_exactly_the_expected_tokens(params, kept):
    out = Sampler(seed=0)(logits_for(PROBS, DRAWS), rows_of(DRAWS, temperature=1.0, **params))
    counts = token_counts(out)
    assert set(counts) == kept
    # The kept tokens keep their relative odds (renormalised): e.g. 0.4 : 0.3 inside {0, 1}.
    total = sum(PROBS[t] for t in kept)
    for t in kept:
        assert counts[t] / DRAWS == pytest.approx(PROBS[t] / total, abs=0.02)


def test_no_filter_samples_the_model_distribution():
    counts = token_counts(Sampler(seed=0)(logits_for(PROBS, DRAWS), rows_of(DRAWS, temperature=1.0)))
    for t, p in enumerate(PROBS):
        assert counts[t] / DRAWS == pytest.approx(p, abs=0.02)


def test_top_p_always_keeps_the_top_token():
    probs = [0.7, 0.2, 0.1]
    out = Sampler(seed=0)(logits_for(probs, 1000), rows_of(1000, temperature=1.0, top_p=0.01))
    assert set(out.token_ids.tolist()) == {0}


def test_top_p_per_row_in_one_batch():
    """Rows with different top-p in one batch each get their own nucleus."""
    n = 2000  # only the support is checked
    rows = rows_of(n, temperature=1.0, top_p=0.35) + rows_of(n, temperature=1.0)
    out = Sampler(seed=0)(logits_for(PROBS, 2 * n), rows)
    assert set(out.token_ids[:n].tolist()) == {0}
    assert set(out.token_ids[n:].tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("other", [{"top_k": 3}, {"top_k": -1}, {"top_p": 0.99}])
def test_top_k_per_row_in_one_batch(other):
    """A row's k holds whatever the other rows ask for (larger k, no k, top-p forcing a full sort)."""
    n = 2000  # only the support is checked
    rows = rows_of(n, temperature=1.0, top_k=1) + rows_of(n, temperature=1.0, top_k=2)
    rows += rows_of(n, temperature=1.0, **other)
    out = Sampler(seed=0)(logits_for(PROBS, 3 * n), rows)
    assert set(out.token_ids[:n].tolist()) == {0}
    assert set(out.token_ids[n : 2 * n].tolist()) == {0, 1}


def test_temperature_sharpens_or_flattens():
    logits = logits_for(PROBS, DRAWS)
    share_of_top = {}
    for temperature in (0.5, 1.0, 2.0):
        counts = token_counts(Sampler(seed=0)(logits, rows_of(DRAWS, temperature=temperature)))
        expected = torch.softmax(logits[0] / temperature, dim=-1)
        for t in range(len(PROBS)):
            assert counts[t] / DRAWS == pytest.approx(expected[t].item(), abs=0.02)
        share_of_top[temperature] = counts[0] / DRAWS
    # exact shares of the top token: 0.53 at T=0.5, 0.40 at T=1, 0.33 at T=2
    assert share_of_top[0.5] > share_of_top[1.0] + 0.1
    assert share_of_top[1.0] > share_of_top[2.0] + 0.05


# ---- penalties ----------------------------------------------------------------------------------


def test_penalties_change_logits_exactly_as_specified():
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
            [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
            [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
        ]
    )
    both = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    rows = [
        Row(both, prompt_token_ids=(0, 1), output_token_ids=[2, 2, 3]),
        Row(SamplingParams(), prompt_token_ids=(0, 1), output_token_ids=[2, 2, 3]),  # no penalties
        Row(SamplingParams(presence_penalty=-1.0), prompt_token_ids=(0, 1), output_token_ids=[4, 4]),
    ]
    before = logits.clone()
    penalised = apply_penalties(logits, rows)
    expected = torch.tensor(
        [
            # 0: prompt, > 0 -> / 2; 1: prompt, < 0 -> * 2;
            # 2: output twice, 0.5 / 2 - 0.5 - 2 * 0.25; 3: output once, -0.5 * 2 - 0.5 - 0.25
            [1.0, -2.0, -0.75, -1.75, 3.0, 0.0],
            [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
            # presence counts output tokens only (once however often they occur), never the prompt
            [2.0, -1.0, 0.5, -0.5, 4.0, 0.0],
        ]
    )
    torch.testing.assert_close(penalised, expected, rtol=0, atol=1e-6)
    assert torch.equal(logits, before)


def test_repetition_penalty_below_one_encourages_seen_tokens():
    logits = torch.tensor([[1.0, -2.0, 0.5]])
    rows = [Row(SamplingParams(repetition_penalty=0.5), prompt_token_ids=(0, 1))]
    torch.testing.assert_close(apply_penalties(logits, rows), torch.tensor([[2.0, -1.0, 0.5]]))


def test_penalties_steer_greedy_away_from_repeats():
    logits = torch.tensor([[3.0, 2.5, 0.0]]).expand(3, -1).contiguous()
    rows = [
        Row(SamplingParams(temperature=0.0), output_token_ids=[0]),
        Row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt_token_ids=(0,)),  # 3 / 1.5 = 2
        Row(SamplingParams(temperature=0.0, frequency_penalty=0.3), output_token_ids=[0, 0]),  # 3 - 0.6
    ]
    assert Sampler(seed=0)(logits, rows).token_ids.tolist() == [0, 1, 1]


def test_frequency_penalty_shifts_sampled_distribution():
    probs = [0.5, 0.5]
    rows = [Row(SamplingParams(temperature=1.0, frequency_penalty=2.0), output_token_ids=[0]) for _ in range(DRAWS)]
    counts = token_counts(Sampler(seed=0)(logits_for(probs, DRAWS), rows))
    # logit of token 0 drops by 2: p(0) = 1 / (1 + e^2)
    assert counts[0] / DRAWS == pytest.approx(1 / (1 + math.e**2), abs=0.02)


# ---- seeds --------------------------------------------------------------------------------------

STEPS = 30


def _run_seeded(seed: int, position: int, others: list[SamplingParams], sampler_seed: int) -> list[int]:
    """STEPS decode steps of one seeded request placed at `position` among `others`; its tokens."""
    step_logits = torch.randn(STEPS, 1, 50, generator=torch.Generator().manual_seed(7))
    target = Row(SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=seed))
    rows = [Row(p) for p in others]
    rows.insert(position, target)
    sampler = Sampler(seed=sampler_seed)
    noise = torch.Generator().manual_seed(sampler_seed)
    tokens = []
    for step in range(STEPS):
        logits = torch.randn(len(rows), 50, generator=noise)
        logits[position] = step_logits[step, 0]
        tokens.append(sampler(logits, rows).token_ids[position].item())
    return tokens


def test_same_seed_same_tokens_whatever_the_batch():
    alone = _run_seeded(1234, 0, [], sampler_seed=0)
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, seed=99, top_k=5),
        SamplingParams(temperature=0.5, min_p=0.1, logprobs=2, presence_penalty=0.5),
    ]
    assert _run_seeded(1234, 2, others, sampler_seed=1) == alone
    assert _run_seeded(1234, 4, others, sampler_seed=2) == alone
    assert _run_seeded(1234, 0, others[::-1], sampler_seed=3) == alone
    assert len(set(alone)) > 5  # actually sampled, not stuck on one token


def test_different_seeds_give_different_tokens():
    assert _run_seeded(1, 0, [], sampler_seed=0) != _run_seeded(2, 0, [], sampler_seed=0)


def test_sampler_seed_makes_unseeded_rows_reproducible():
    logits = torch.zeros(200, 100)  # uniform
    rows = rows_of(200, temperature=1.0)
    first = Sampler(seed=5)(logits, rows).token_ids
    assert torch.equal(Sampler(seed=5)(logits, rows).token_ids, first)
    assert not torch.equal(Sampler(seed=6)(logits, rows).token_ids, first)
    # Unseeded samplers draw fresh entropy.
    assert not torch.equal(Sampler()(logits, rows).token_ids, Sampler()(logits, rows).token_ids)


def test_sampler_leaves_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    Sampler()(torch.zeros(8, 10), rows_of(8, temperature=1.0))
    Sampler(seed=1)(torch.zeros(8, 10), rows_of(8, temperature=1.0, top_p=0.5, seed=3))
    assert torch.equal(torch.rand(3), expected)


# ---- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    rows = [
        Row(SamplingParams(temperature=0.0, logprobs=3)),
        Row(SamplingParams(temperature=0.7, top_k=10, logprobs=5, seed=1)),
        Row(SamplingParams(temperature=1.5, top_p=0.5, logprobs=0)),
        Row(SamplingParams(temperature=0.0)),  # asks for none; still gets a row, ignored by the runner
        # Penalties and temperature change the sampling, never the reported logprobs.
        Row(SamplingParams(temperature=2.0, repetition_penalty=1.7, logprobs=2), (0, 1, 2), [3]),
    ]
    out = Sampler(seed=0)(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    top = raw.topk(5, dim=-1)
    lp = out.logprobs
    assert lp is not None
    assert lp.top_ids.shape == (5, 5) and lp.top_ids.dtype == torch.int64
    assert torch.equal(lp.top_ids, top.indices)
    torch.testing.assert_close(lp.top_logprobs, top.values)
    sampled = raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(lp.sampled_logprobs, sampled)
    assert lp.sampled_logprobs.dtype == torch.float32
    assert lp.sampled_ranks.dtype == torch.int64
    expected_ranks = [1 + int((raw[b] > sampled[b]).sum()) for b in range(5)]
    assert lp.sampled_ranks.tolist() == expected_ranks
    assert lp.sampled_ranks[0] == 1 and lp.sampled_ranks[3] == 1  # greedy rows
    # A penalised greedy pick need not be rank 1 of the raw distribution.
    rows = [Row(SamplingParams(temperature=0.0, logprobs=1, repetition_penalty=10.0), (int(logits[0].argmax()),))]
    assert Sampler()(logits[:1], rows).logprobs.sampled_ranks.tolist() == [2]


def test_sampled_logprob_and_rank_match_the_token_drawn():
    out = Sampler(seed=0)(logits_for(PROBS, 2000), rows_of(2000, temperature=1.0, logprobs=1))
    lp = out.logprobs
    logprob_of = torch.tensor(PROBS).log()
    torch.testing.assert_close(lp.sampled_logprobs, logprob_of[out.token_ids])
    assert torch.equal(lp.sampled_ranks, out.token_ids + 1)  # PROBS is in descending order
    assert set(lp.sampled_ranks.tolist()) == {1, 2, 3, 4}


def test_logprobs_zero_gives_sampled_only():
    out = Sampler(seed=0)(torch.randn(2, 10), rows_of(2, temperature=0.0, logprobs=0))
    assert out.logprobs is not None
    assert out.logprobs.top_ids.shape == (2, 0) and out.logprobs.top_logprobs.shape == (2, 0)
    assert out.logprobs.sampled_ranks.tolist() == [1, 1]


# ---- mixed batches ------------------------------------------------------------------------------


def test_mixed_greedy_and_sampled_batch():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(4))
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=1.0, top_k=3)
    rows = [Row(greedy), Row(sampled), Row(greedy), Row(sampled), Row(greedy), Row(sampled)]
    sampler = Sampler(seed=0)
    top3 = logits.topk(3, dim=-1).indices
    seen_at_row_1 = set()
    for _ in range(50):
        ids = sampler(logits, rows).token_ids
        assert torch.equal(ids[[0, 2, 4]], logits[[0, 2, 4]].argmax(dim=-1))
        for b in (1, 3, 5):
            assert ids[b] in top3[b]
        seen_at_row_1.add(ids[1].item())
    assert seen_at_row_1 == set(top3[1].tolist())  # sampled rows really sample


def test_empty_vocab_filters_are_noops_for_large_top_k():
    """top_k >= V means the whole vocabulary, like top_k=-1."""
    counts = token_counts(Sampler(seed=0)(logits_for(PROBS, DRAWS), rows_of(DRAWS, temperature=1.0, top_k=100)))
    assert set(counts) == {0, 1, 2, 3}


# ---- logit_bias and min_tokens ------------------------------------------------------------------------


def test_logit_bias_moves_the_pick_per_row_and_leaves_other_rows_alone():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    rows = [Row(SamplingParams(temperature=0.0, logit_bias={7: 100})), Row(SamplingParams(temperature=0.0)),
            Row(SamplingParams(temperature=0.0, logit_bias={int(logits[2].argmax()): -100}))]
    out = Sampler(seed=0)(logits, rows).token_ids.tolist()
    assert out[0] == 7 and out[1] == int(logits[1].argmax())
    assert out[2] == int(logits[2].topk(2).indices[1])  # the best one banned: the runner-up
    sampled = Sampler(seed=0)(logits[:1].expand(2000, -1).contiguous(),
                              [Row(SamplingParams(temperature=1.0, logit_bias={3: 100}))] * 2000)
    assert set(sampled.token_ids.tolist()) == {3}


def test_min_tokens_bans_the_stop_ids_until_enough_are_out():
    logits = torch.zeros(2, 10)
    logits[:, 1] = 5.0  # EOS would win greedily
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=8)
    early = Row(params, output_token_ids=[4], stop_ids=(1,))
    done = Row(params, output_token_ids=[4, 4], stop_ids=(1,))
    assert Sampler(seed=0)(logits, [early, done]).token_ids.tolist() == [0, 1]


def test_logprobs_stay_those_of_the_raw_distribution_under_a_bias():
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(2))
    out = Sampler(seed=0)(logits, [Row(SamplingParams(temperature=0.0, logprobs=1, logit_bias={5: 100}))])
    assert out.token_ids.tolist() == [5]
    assert out.logprobs.sampled_logprobs[0].item() == pytest.approx(logits.log_softmax(-1)[0, 5].item())


@pytest.mark.parametrize("scale, among_candidates", [(12.0, True), (1.0, False)])
def test_top_p_among_candidates_equals_the_full_sort(scale, among_candidates):
    """A large vocabulary's nucleus is looked for among each row's most likely tokens first (a peaked row holds it
    there; a flat one does not and takes the full sort): the same logits kept either way, top-k rows too."""
    from pagellm.runner.sampler import _apply_top_k_top_p, _nucleus_among_candidates, _nucleus_by_full_sort

    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 40000, generator=generator) * scale
    params = [SamplingParams(top_p=0.95), SamplingParams(top_p=0.5, top_k=50), SamplingParams(top_k=20),
              SamplingParams(top_p=0.9, top_k=500), SamplingParams(top_p=0.7)]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else 0 for p in params])
    top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
    assert (_nucleus_among_candidates(logits.clone(), top_k, top_p) is not None) == among_candidates
    kept, full = _apply_top_k_top_p(logits.clone(), params), _nucleus_by_full_sort(logits.clone(), top_k, top_p)
    assert torch.equal(kept, full)


# ---- the draw on a CPU ----------------------------------------------------------------------------


@pytest.mark.parametrize("vocab, block", [(10, 4), (12, 4), (7, 16), (3000, 1024)])
def test_the_inverse_cdf_draw_finds_the_token_a_full_cumulative_sum_finds(vocab, block):
    """Two levels (blocks, then a token within one) against one float64 cumulative sum over the whole row, for
    u over a fine grid and at its ends: the same token, a token of probability 0 never (filtered tokens, a short
    last block)."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(6, vocab, generator=generator) ** 4  # unnormalised, uneven
    probs[:, ::3] = 0.0  # filtered tokens
    probs[1, -2:] = 0.0  # the last block's tail empty
    probs[2, : vocab // 2] = 0.0  # whole blocks empty
    u = torch.cat([torch.linspace(0.0, 1.0 - 1e-9, 997, dtype=torch.float64),  # torch.rand's float32 values are
                   torch.tensor([1.0 - 2.0**-24], dtype=torch.float64)])  # below 1: its largest is 1 - 2^-24
    for row in range(probs.shape[0]):
        cdf = probs[row].double().cumsum(0)
        expected = torch.searchsorted(cdf, u * cdf[-1], right=True)
        got = sample_inverse_cdf(probs[row].expand(len(u), -1).contiguous(), u, block=block)
        assert (probs[row][got] > 0).all()
        # a block's float32 sum and a float64 sum round apart: a u that lands between the two may move one token
        assert (got != expected).float().mean() < 0.01 and ((got - expected).abs() <= 1).all()


def test_a_large_vocabularys_tail_is_drawn_at_its_share():
    """Half the mass on one token, half spread over the 262143 others (each under 2e-6, 256 blocks): the tail keeps
    its half."""
    vocab, draws = 262144, 4000
    logits = torch.full((1, vocab), math.log(0.5 / (vocab - 1)))
    logits[0, 0] = math.log(0.5)
    ids = torch.cat([Sampler(seed=i)(logits.clone(), rows_of(1, temperature=1.0)).token_ids for i in range(draws)])
    assert (ids == 0).float().mean().item() == pytest.approx(0.5, abs=0.03)
    assert ids.max().item() > vocab // 2  # the far end of the row is reached


def test_degenerate_rows_draw_a_token_of_the_vocabulary():
    """A top_p that rounds to 0 in float32 keeps the top token; a row with no mass left (every logit -inf) or
    infinite logits (a tiny temperature) draws a token inside the vocabulary, never past it."""
    probs = [0.1, 0.6, 0.3]
    out = Sampler(seed=0)(logits_for(probs, 50), rows_of(50, temperature=1.0, top_p=5e-324))
    assert set(out.token_ids.tolist()) == {1}
    logits = torch.full((2, 5), float("-inf"))
    logits[1] = torch.tensor([0.0, 1.0, 3.0, 2.0, 1.0])
    out = Sampler(seed=0)(logits, rows_of(2, temperature=1e-30))
    assert out.token_ids.tolist()[1] == 2 and 0 <= out.token_ids.tolist()[0] < 5
