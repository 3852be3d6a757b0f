"""The C++ sampled-token draw (pagellm/kernels/cpu/token_sampling.py) against the sampler's torch chain: the same
filters (temperature, top-k with ties, top-p, min-p), the same token from the same uniform, a grid of uniforms
landing on each kept token in proportion to its share, and one answer at every level."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm.kernels.build import native
from pagellm.kernels.cpu import token_sampling
from pagellm.runner.sampler import Sampler
from pagellm.sampling_params import SamplingParams
from tests.kernels import requires_compiler

pytestmark = requires_compiler
LEVELS = [level for level in native.host_levels() if token_sampling.available(level)]
BUILT_AT = pytest.mark.levels("avx512", "avx2")  # not at generic (kernels/cpu/token_sampling.py says why)


class Row:
    def __init__(self, params: SamplingParams):
        self.sampling_params, self.prompt_token_ids, self.output_token_ids = params, [1], []
        self.num_output_tokens, self.generator, self.stop_ids, self.grammar = 0, None, [1], None


def _separated_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows whose probabilities halve token by token down a random order (then a flat tail): no boundary of the
    mass lies near another, so float32 and float64 sums pick the same tokens."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.full((rows, vocab), -30.0)
    for r in range(rows):
        order = torch.randperm(vocab, generator=gen)[:12]
        logits[r, order] = -math.log(2) * torch.arange(12, dtype=torch.float32) + float(r % 3)
    return logits


PARAMS = {
    "temperature": dict(temperature=0.7),
    "top-k": dict(temperature=1.0, top_k=3),
    "top-p": dict(temperature=1.0, top_p=0.8),
    "min-p": dict(temperature=1.3, min_p=0.1),
    "all": dict(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05),
}


@pytest.mark.across_levels
@pytest.mark.parametrize("name", PARAMS)
@pytest.mark.parametrize("vocab", [17, 3001])
def test_the_kernel_draws_the_torch_chains_token_from_the_same_uniform(name, vocab):
    if not LEVELS:
        pytest.skip("the kernel is built at avx512 and avx2 only, which this CPU cannot run")
    logits = _separated_logits(40, vocab, seed=vocab)
    rows = [Row(SamplingParams(**PARAMS[name])) for _ in range(40)]
    for level in LEVELS:
        for seed in range(3):
            native_ids = Sampler(seed=seed, kernel_level=level)(logits.clone(), rows).token_ids
            torch_ids = Sampler(seed=seed, kernel_level=None)(logits.clone(), rows).token_ids
            assert native_ids.tolist() == torch_ids.tolist(), (level, seed)


def _grid_counts(row: torch.Tensor, level: str, draws: int = 10_000, **params) -> torch.Tensor:
    """How often each token is drawn by uniforms on a grid of `draws` points: n * share +- 1 for an exact draw."""
    u = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    ids = token_sampling.sample_rows(row.expand(draws, -1).contiguous(), [params.get("temperature", 1.0)] * draws,
                                     [params.get("top_k", 0)] * draws, [params.get("top_p", 1.0)] * draws,
                                     [params.get("min_p", 0.0)] * draws, u, level)
    return torch.bincount(ids, minlength=row.shape[0])


@BUILT_AT
def test_a_grid_of_uniforms_lands_on_each_kept_token_by_its_share(cpu_isa):
    level = cpu_isa
    probs = torch.tensor([0.3, 0.2, 0.2, 0.15, 0.1, 0.05])
    row = probs.log()
    cases = [  # (params, the kept tokens' shares)
        (dict(), probs),
        (dict(top_k=2), torch.tensor([0.3, 0.2, 0.2, 0, 0, 0]) / 0.7),  # the second and third tie: both kept
        (dict(top_k=3), torch.tensor([0.3, 0.2, 0.2, 0, 0, 0]) / 0.7),
        (dict(top_p=0.55), torch.tensor([0.3, 0.2, 0.2, 0, 0, 0]) / 0.7),  # 0.5 before the third: kept
        (dict(top_p=0.5), torch.tensor([0.3, 0.2, 0, 0, 0, 0]) / 0.5),  # ties by id: the lower one first
        (dict(min_p=0.45), torch.tensor([0.3, 0.2, 0.2, 0.15, 0, 0]) / 0.85),
        (dict(temperature=0.5), probs**2 / (probs**2).sum()),
    ]
    for params, shares in cases:
        counts = _grid_counts(row, level, **params)
        assert (counts.double() - 10_000 * shares.double()).abs().max() <= 1.0, (params, counts.tolist())


def _assert_shares(counts: torch.Tensor, kept: torch.Tensor, e: torch.Tensor) -> None:
    """Each kept token drawn n * its share of the kept mass, +- 1; the others never."""
    shares = torch.where(kept, e, torch.zeros_like(e))
    shares = shares / shares.sum()
    assert counts[~kept].sum() == 0
    assert (counts.double() - counts.sum() * shares).abs().max() <= 1.0


@BUILT_AT
def test_a_nucleus_or_top_k_below_the_first_thresholds_is_found(cpu_isa):
    """Most of the mass in tokens under the first threshold (2^-10 of the top token's): the filters look lower.
    Top-p 0.5 over one token and 4999 of e = 5e-4 keeps the top one and the first 1500 of the tail by id (a
    stable sort's ties); top-k 3000 over 10 tokens and a tail falling from e^-8 keeps the tail's first 2990."""
    row = torch.full((5000,), math.log(5e-4))
    row[0] = 0.0
    kept = torch.arange(5000) <= 1500
    _assert_shares(_grid_counts(row, cpu_isa, top_p=0.5), kept, row.double().exp())
    row = -8.0 - 1e-3 * torch.arange(5000, dtype=torch.float32)
    row[:10] = 0.0
    _assert_shares(_grid_counts(row, cpu_isa, draws=20_000, top_k=3000), torch.arange(5000) < 3000,
                   row.double().exp())


@BUILT_AT
def test_rows_without_mass_or_with_infinities_get_a_token_of_the_vocabulary(cpu_isa):
    level = cpu_isa
    u = torch.tensor([0.0, 0.5, 0.999999])
    everything_masked = torch.full((3, 40), float("-inf"))
    assert token_sampling.sample_rows(everything_masked, [1.0] * 3, [0, 5, 0], [1.0, 1.0, 0.9], [0.0] * 3, u,
                                      level).tolist() == [0, 0, 0]
    infinite = torch.zeros(3, 40)
    infinite[:, 7] = float("inf")
    infinite[:, 9] = float("nan")  # a NaN logit is never drawn
    got = token_sampling.sample_rows(infinite, [1.0, 1e-30, 1.0], [0, 0, 3], [1.0, 0.5, 1.0], [0.0] * 3, u, level)
    assert got.tolist() == [7, 7, 7]
    nan_row = torch.zeros(1, 40)
    nan_row[0, :39] = float("nan")
    assert token_sampling.sample_rows(nan_row, [1.0], [0], [1.0], [0.0], torch.tensor([0.0]), level).tolist() == [39]


@pytest.mark.across_levels
def test_every_level_draws_the_same_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(24, 262144 + 5, generator=gen) * 3
    u = torch.rand(24, dtype=torch.float64, generator=gen)
    params = ([0.8] * 24, [0, 40] * 12, [0.95] * 8 + [1.0] * 16, [0.0] * 16 + [0.02] * 8)
    results = {level: token_sampling.sample_rows(logits, *params, u, level) for level in LEVELS}
    assert len({tuple(ids.tolist()) for ids in results.values()}) == 1, results


@BUILT_AT
def test_bad_calls_are_named(cpu_isa):
    level = cpu_isa
    with pytest.raises(ValueError, match="temperatures must be positive"):
        token_sampling.sample_rows(torch.zeros(1, 4), [0.0], [0], [1.0], [0.0], torch.zeros(1), level)
    with pytest.raises(ValueError, match="one temperature, top_k, top_p and min_p per row"):
        token_sampling.sample_rows(torch.zeros(2, 4), [1.0], [0], [1.0], [0.0], torch.zeros(2), level)
    with pytest.raises(ValueError, match="contiguous CPU fp32 logits"):
        token_sampling.sample_rows(torch.zeros(2, 4).double(), [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2,
                                   torch.zeros(2), level)


@pytest.mark.across_levels
def test_a_temperature_below_vllms_epsilon_is_greedy():
    """1e-38 in float32 would scale every positive logit past its range (a tie among them all): such a request is
    greedy, as in vLLM, whichever path samples."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]]).expand(64, -1).contiguous()
    rows = [Row(SamplingParams(temperature=1e-38)) for _ in range(64)]
    for level in [*LEVELS, None]:
        assert set(Sampler(seed=0, kernel_level=level)(logits.clone(), rows).token_ids.tolist()) == {1}
    assert not SamplingParams(temperature=1e-5).is_greedy
