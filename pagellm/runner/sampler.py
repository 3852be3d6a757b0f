"""Sampler: turn one step's logits [B, V] into one next token per request.

Each stage runs only if some row in the batch needs it:

    raw logits ─► log_softmax ─────────────────────────────────────────► logprobs (raw model distribution)
        │
        ▼
    logit_bias, min_tokens' ban on stop ids, grammar masks (runner/grammar.py)
        │
        ▼
    penalties (repetition over prompt + output; presence, frequency over output)
        ├─► argmax ───────────────────────────────────────────────────► greedy rows
        ▼
    / temperature ─► top-k ─► top-p ─► exp (unnormalised) ─► min-p ─► a draw ─────────► sampled rows
                                                   on a CPU: the inverse of the cumulative mass at u ~ U[0, 1)
                                                   (all five stages one kernel where the level has it:
                                                   kernels/cpu/token_sampling.py); elsewhere: argmax(probs / q),
                                                   q ~ Exp(1); u and q from the row's own generator if it has a
                                                   seed, else the sampler's

Every decision is taken from host-side SamplingParams, never from tensor values, so __call__ does not
wait on the device (no host sync; on a CPU, where a read costs nothing, top-p reads its candidates' mass); the
runner reads the result back with a single .tolist().
B = batch rows, V = vocabulary, K = most top logprobs any row asked for, N = rows with penalties.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagellm.kernels.transfers import to_device
from pagellm.kernels.build import native
from pagellm.kernels.cpu import logits as logits_kernels
from pagellm.kernels.cpu import token_sampling
from pagellm.kernels.build.native import DEFAULT_LEVEL
from pagellm.runner.grammar import GrammarMasks
from pagellm.runner.token_draws import sample_exponential_race_no_sync, sample_inverse_cdf
from pagellm.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What the engine's request provides for one logits row."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (with those of a launched step not yet read back, which output_token_ids
        lacks: penalties, which read the ids, never run with such a step in flight)."""
        ...

    @property
    def generator(self) -> torch.Generator | None:
        """Set by the runner's input batch iff sampling_params.seed is not None, on the logits' device."""
        ...

    @property
    def stop_ids(self) -> Sequence[int]:
        """The ids that would end the request (EOS unless ignored, stop_token_ids): banned before min_tokens."""
        ...

    @property
    def grammar(self):
        """The request's RowGrammar (runner/grammar.py) when it has structured_outputs, else None."""
        ...


@dataclass(frozen=True)
class LogprobsTensors:
    sampled_logprobs: torch.Tensor  # [B] float32, logprob of the sampled token
    sampled_ranks: torch.Tensor  # [B] int64, 1 + number of tokens strictly more likely than the sampled one
    top_ids: torch.Tensor  # [B, K] int64, most likely first; a row that asked for n < K uses [:n]
    top_logprobs: torch.Tensor  # [B, K] float32


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    def __init__(self, seed: int | None = None, kernel_level: str | None = DEFAULT_LEVEL, pinned: bool = False):
        """kernel_level: the CPU kernels' level its argmax and masks run at (None: torch's ops; by default the
        process default, native.default_level(); the runner passes its engine's). pinned: host buffers bound for
        a device (grammar masks) are pinned (not Backend.host_memory)."""
        self._seed = seed
        level = native.default_level() if kernel_level == DEFAULT_LEVEL else kernel_level
        self._argmax = greedy_argmax(level)
        # a CPU's sampled rows in one kernel where the level has it (kernels/cpu/token_sampling.py)
        self._native_draw = functools.partial(token_sampling.sample_rows, at=level) if token_sampling.available(
            level) else None
        # Rows without a seed draw from here. One generator per device, made on first use because
        # the device is only known once logits arrive.
        self._generators: dict[torch.device, torch.Generator] = {}
        self._grammar_masks = GrammarMasks(level, pinned)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow], *, overwrite: bool = False) -> SamplerOutput:
        """overwrite: the logits are the caller's to lose (the runner's are), so per-row changes (bias, grammar
        masks) are made in them rather than in a copy: a [64, 262144] copy costs milliseconds."""
        params = [row.sampling_params for row in rows]
        wants_logprobs = any(p.logprobs is not None for p in params)
        needs_penalties = any(p.needs_penalties for p in params)
        processed = any(p.needs_logit_processing for p in params)
        if not wants_logprobs and not needs_penalties and not processed and all(p.is_greedy for p in params):
            return SamplerOutput(token_ids=self._argmax(logits), logprobs=None)

        given = logits
        logits = logits.float()  # sampling maths in fp32 whatever the model's dtype; no copy if already fp32
        # vLLM returns logprobs of the raw model distribution, before penalties and temperature.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        if processed:
            if logits is given and not overwrite:
                logits = logits.clone()
            apply_logit_bias_and_min_tokens(logits, rows)
            self._grammar_masks.apply(logits, [row.grammar for row in rows])
        if needs_penalties:
            logits = apply_penalties(logits, rows)
        # the sampling stages work in place where the logits are this call's or the caller gave them up
        token_ids = self._pick_tokens(logits, rows, owned=overwrite or logits is not given)
        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None)
        num_top = max(p.logprobs or 0 for p in params)
        return SamplerOutput(token_ids=token_ids, logprobs=gather_logprobs(raw_logprobs, token_ids, num_top))

    # ---- internal helpers -------------------------------------------------------------------------

    def _pick_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow], owned: bool) -> torch.Tensor:
        """owned: the logits may be changed in place."""
        greedy = [row.sampling_params.is_greedy for row in rows]
        if all(greedy):
            return self._argmax(logits)
        greedy_ids = self._argmax(logits) if any(greedy) else None  # before sampling overwrites the logits
        sampled = self._sample(logits, rows, owned)
        if greedy_ids is None:
            return sampled
        return torch.where(to_device(greedy, torch.bool, logits.device), greedy_ids, sampled)

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow], owned: bool) -> torch.Tensor:
        """Sample every row (greedy rows too; the caller discards those) from its filtered distribution; owned:
        the logits may be overwritten."""
        if self._native_draw is not None and logits.device.type == "cpu":
            return self._draw_natively(logits, rows)
        if logits.device.type == "cpu" and len(rows) > _ROWS_AT_ONCE:
            return torch.cat([self._sample(logits[i : i + _ROWS_AT_ONCE], rows[i : i + _ROWS_AT_ONCE], owned)
                              for i in range(0, len(rows), _ROWS_AT_ONCE)])
        params = [row.sampling_params for row in rows]
        device = logits.device
        # Greedy rows get temperature 1 only to stay finite; their samples are thrown away.
        temperature = _column([1.0 if p.is_greedy else p.temperature for p in params], logits.dtype, device)
        # the filters below work in place: on the logits when they are ours, else on a new tensor
        logits = logits.div_(temperature) if owned else logits / temperature
        logits = _apply_top_k_top_p(logits, params)
        # unnormalised (the draws and min-p need only ratios), in place: a softmax's two more passes saved. Finite
        # first: an infinite logit (a tiny temperature) would give inf - inf, a row all -inf -inf + inf
        finite = torch.finfo(logits.dtype).max
        logits.clamp_(max=finite)
        probs = logits.sub_(logits.amax(dim=-1, keepdim=True).clamp_min_(-finite)).exp_()
        if any(p.min_p > 0.0 for p in params):
            probs = _apply_min_p(probs, _column([p.min_p for p in params], probs.dtype, device))
        if device.type == "cpu":  # one uniform a row: a CPU draws V exponentials in milliseconds (Gemma's 262144)
            return sample_inverse_cdf(probs, self._uniforms(rows, device))
        return sample_exponential_race_no_sync(probs, self._exponential_noise(probs, rows), self._argmax)

    def _draw_natively(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """_sample's stages in one kernel call, the logits only read; the same filters, and the same draw from the
        same uniform (its sums in float64: a token at a boundary of the mass may differ by rounding)."""
        params = [row.sampling_params for row in rows]
        vocab = logits.shape[-1]
        return self._native_draw(
            logits.contiguous(), [1.0 if p.is_greedy else p.temperature for p in params],
            _top_ks(params, vocab), _top_ps(params, off=1.0), [p.min_p for p in params],
            self._uniforms(rows, logits.device))

    def _uniforms(self, rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
        """u ~ U[0, 1), [B]: a seeded row's from its own generator (its tokens whatever the batch), the rest in one
        draw from the sampler's."""
        u = torch.rand(len(rows), generator=self._generator(device), device=device)
        for i, row in enumerate(rows):
            if row.generator is not None and not row.sampling_params.is_greedy:
                u[i] = torch.rand((), generator=row.generator, device=device)
        return u

    def _exponential_noise(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """q ~ Exp(1), [B, V]. A seeded row's noise comes only from its own generator, so its tokens do
        not depend on what else is in the batch or where the row sits in it."""
        seeded = [i for i, row in enumerate(rows) if row.generator is not None and not row.sampling_params.is_greedy]
        noise = torch.empty_like(probs)
        if len(seeded) < len(rows):
            noise.exponential_(generator=self._generator(probs.device))  # one batched draw for the rest
        for i in seeded:
            noise[i].exponential_(generator=rows[i].generator)
        return noise

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()  # fresh OS entropy; never touches torch's global RNG
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator


# On a CPU rows are sampled this many at a time: each stage makes a [rows, V] temporary, kept below glibc's largest
# mmap threshold for a large vocabulary so that the heap reuses its pages instead of faulting them in afresh.
_ROWS_AT_ONCE = 8


def greedy_argmax(level: str | None):
    """logits [B, V] fp32 -> logits.argmax(dim=-1), natively where the CPU kernels' `level` has the kernel, else
    torch's (another device, no level), chosen once: torch's CPU argmax is slow on a batch of vocab-sized rows
    (measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md)."""
    if logits_kernels.available("argmax_rows", level):
        return functools.partial(logits_kernels.argmax_rows, at=level)
    return functools.partial(torch.argmax, dim=-1)


def apply_logit_bias_and_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: each row's logit_bias added to logits [B, V], and its stop ids at -inf while fewer than
    min_tokens tokens are out (vLLM's order: before penalties and temperature)."""
    bias_rows, bias_ids, biases, ban_rows, ban_ids = [], [], [], [], []
    for i, row in enumerate(rows):
        params = row.sampling_params
        for token, bias in params.logit_bias or ():
            bias_rows.append(i), bias_ids.append(token), biases.append(bias)
        if row.num_output_tokens < params.min_tokens:
            ban_rows.extend([i] * len(row.stop_ids)), ban_ids.extend(row.stop_ids)
    device = logits.device
    if biases:  # one indexed add for every row's bias (a bias dict names each token once)
        logits.index_put_((to_device(bias_rows, torch.int64, device), to_device(bias_ids, torch.int64, device)),
                          to_device(biases, logits.dtype, device), accumulate=True)
    if ban_ids:  # after the biases: -inf whatever a bias said
        logits.index_put_((to_device(ban_rows, torch.int64, device), to_device(ban_ids, torch.int64, device)),
                          logits.new_full((), float("-inf")))


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Logits [B, V] with repetition, presence and frequency penalties applied, as a new tensor.

    repetition (HF / vLLM): every token seen in prompt or output: logit / p if logit > 0 else logit * p
    presence, frequency (OpenAI): logit -= presence * (count > 0) + frequency * count, output tokens only
    Rows that need no penalty are left as they are; only the N rows that do are gathered and processed.
    """
    picked = [i for i, row in enumerate(rows) if row.sampling_params.needs_penalties]
    if not picked:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    params = [rows[i].sampling_params for i in picked]
    index = to_device(picked, torch.int64, device)
    sub = logits.index_select(0, index)  # [N, V]
    output_counts = _token_counts([rows[i].output_token_ids for i in picked], vocab, sub.dtype, device)  # [N, V]
    output_seen = output_counts > 0

    if any(p.repetition_penalty != 1.0 for p in params):  # skip scattering long prompts when unused
        prompt_seen = _token_counts([rows[i].prompt_token_ids for i in picked], vocab, sub.dtype, device) > 0
        repetition = _column([p.repetition_penalty for p in params], sub.dtype, device)
        penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(prompt_seen | output_seen, penalised, sub)
    frequency = _column([p.frequency_penalty for p in params], sub.dtype, device)
    presence = _column([p.presence_penalty for p in params], sub.dtype, device)
    sub = sub - frequency * output_counts - presence * output_seen.to(sub.dtype)
    return logits.index_copy(0, index, sub)


def _column(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(values, dtype, device).unsqueeze(1)  # [N, 1], broadcasts over V


def _token_counts(
    token_lists: list[Sequence[int]], vocab: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[N, V] occurrences of each token id per row, by one scatter_add over a padded [N, L] id tensor."""
    id_rows = [torch.as_tensor(tokens, dtype=torch.int64) for tokens in token_lists]
    # Pad with id V, which lands in a spare column that is cut off afterwards.
    ids = torch.nn.utils.rnn.pad_sequence(id_rows, batch_first=True, padding_value=vocab)  # [N, L]
    ids = to_device(ids, torch.int64, device)
    counts = torch.zeros(len(id_rows), vocab + 1, dtype=dtype, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=dtype))
    return counts[:, :vocab]


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set logits outside each row's top-k and then outside its nucleus (top-p) to -inf.

    Ties with the k-th largest logit are kept (as in vLLM). A full sort only happens if some row uses top-p;
    top-k alone needs just torch.topk up to the largest k asked for.
    """
    vocab = logits.shape[-1]
    top_k = _top_ks(params, vocab)
    any_top_p = any(p.top_p < 1.0 for p in params)
    if not any_top_p and not any(top_k):
        return logits
    k = to_device(top_k, torch.int64, logits.device)
    if not any_top_p:
        largest = logits.topk(max(top_k), dim=-1).values  # [B, max k], descending
        return logits.masked_fill_(logits < _kth_largest(largest, k), float("-inf"))
    top_p = _top_ps(params, off=float("inf"))
    # (on a CPU, where reading the candidates' mass back costs nothing; every row's support among them)
    if logits.device.type == "cpu" and vocab > 2 * _NUCLEUS_CANDIDATES and max(top_k) <= _NUCLEUS_CANDIDATES \
            and all(p < 1.0 or k_ for p, k_ in zip(top_p, top_k)):
        kept = _nucleus_among_candidates(logits, k, top_p)
        if kept is not None:
            return kept
    return _nucleus_by_full_sort(logits, k, top_p)


_SMALLEST_TOP_P = float(torch.finfo(torch.float32).tiny)


def _top_ks(params: list[SamplingParams], vocab: int) -> list[int]:
    """Each row's top-k, 0 where off (also for k >= V)."""
    return [p.top_k if 0 < p.top_k < vocab else 0 for p in params]


def _top_ps(params: list[SamplingParams], off: float) -> list[float]:
    """Each row's top-p, `off` where off; a top_p below float32's smallest normal (5e-324, say) would round to 0
    and drop the top token too, so it is held there."""
    return [max(p.top_p, _SMALLEST_TOP_P) if p.top_p < 1.0 else off for p in params]

# Top-p first looks for the nucleus among each row's most likely tokens: sorting a large vocabulary (262144
# tokens: Gemma 3) costs tens of milliseconds a row on a CPU, the candidates' top-k a fraction of that.
_NUCLEUS_CANDIDATES = 1024


def _nucleus_among_candidates(logits: torch.Tensor, k: torch.Tensor, top_p: list[float]) -> torch.Tensor | None:
    """_nucleus_by_full_sort's result from the _NUCLEUS_CANDIDATES largest logits of each row, or None where some
    row's nucleus may reach past them (their mass, after top-k, below its top_p). Exact: a token outside the
    candidates has at least their whole mass ranked above it, so a row whose candidates hold top_p drops it."""
    candidates, order = logits.topk(_NUCLEUS_CANDIDATES, dim=-1)  # [B, C] descending
    candidates.masked_fill_(candidates < _kth_largest(candidates, k), float("-inf"))
    # the row's distribution over the whole vocabulary (top-k rows: over their k, all among the candidates)
    total = torch.where(k.unsqueeze(1) > 0, candidates.logsumexp(-1, keepdim=True), logits.logsumexp(-1, keepdim=True))
    probs = (candidates - total).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    threshold = _column(top_p, probs.dtype, probs.device)
    # a top-k row without top-p (threshold inf) has all its tokens among the candidates
    if bool(((mass_before[:, -1:] + probs[:, -1:] < threshold) & threshold.isfinite()).any()):  # a host read
        return None
    candidates.masked_fill_(mass_before >= threshold, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, candidates)


def _nucleus_by_full_sort(logits: torch.Tensor, k: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Logits outside each row's top-k, then outside its nucleus (top_p; inf: none) at -inf, from a full sort."""
    # stable: rows with tied logits sort the same way whatever else is in the batch
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    sorted_logits.masked_fill_(sorted_logits < _kth_largest(sorted_logits, k), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each token
    # Keep tokens until the kept mass reaches top_p: the smallest prefix with mass >= top_p. The top
    # token has mass_before == 0 < top_p, so it always survives. Rows without top-p get an infinite
    # threshold, so rounding that pushes the cumulative mass past 1.0 cannot drop their tail.
    sorted_logits.masked_fill_(mass_before >= _column(top_p, probs.dtype, probs.device), float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


def _kth_largest(descending: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[B, 1] per-row k-th largest value from values sorted descending; -inf (keep all) where k == 0."""
    kth = descending.gather(1, (k - 1).clamp_min(0).unsqueeze(1))
    return kth.masked_fill_(k.unsqueeze(1) == 0, float("-inf"))


def _apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens with prob < min_p * max prob (min_p is [B, 1]). Ratios to the max are unchanged by
    renormalising, so probs need not sum to 1 here, and the sampler below does not need them to."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return probs.masked_fill_(probs < threshold, 0.0)


def gather_logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Logprob and rank of token_ids[b] in row b, and each row's num_top best (also for prompt logprobs)."""
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [B, 1]
    # Ties with the sampled token do not push it down, so a greedy token always ranks 1.
    # (vLLM counts ties as ahead, >=; the two differ only on exact ties.)
    ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
    top = raw_logprobs.topk(num_top, dim=-1)  # num_top may be 0: rows asked only for the sampled token
    return LogprobsTensors(
        sampled_logprobs=sampled.squeeze(1),
        sampled_ranks=ranks,
        top_ids=top.indices,
        top_logprobs=top.values,
    )
