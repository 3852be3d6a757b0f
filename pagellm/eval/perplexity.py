"""`pagellm eval perplexity`: llama-perplexity's method on pagellm's forward, and the per-position scores
(NLL, KL to a reference, top-1 agreement) that `pagellm bench accuracy` reports too.

llama-perplexity's method (tools/perplexity/perplexity.cpp, `perplexity()`):

    text ─► token ids (one BOS first, when the tokenizer adds one)
         ─► non-overlapping windows of ctx tokens from the start; a window's first token is replaced by BOS
         ─► each window runs alone; positions ctx/2 .. ctx-2 are scored, each predicting the next token
            (the first half is context only, so every scored token sees at least ctx/2 tokens)

    PPL = exp(mean NLL) +/- PPL * sqrt(var(NLL) / (N - 1)), as its "Final estimate" line prints it.

With a reference (`--kl-base dense`: the dense fp32 model of the same file) the same scored positions
also give mean KL(reference || model) and how often both pick the same top token, each with its
standard error, as llama-perplexity's --kl-divergence mode reports them.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.config import KernelConfig
from pagellm.eval.forward import (is_dense_mode, load_dense_reference, load_mode, mode_backend, pagellm_logits,
                                  tokenize_text)
from pagellm.loader.model_loader import resolve_model_path


@dataclass(frozen=True)
class PositionScores:
    """Per scored position (N of them)."""

    nll: torch.Tensor  # [N] float64, -log p_model(next token)
    kl: torch.Tensor | None  # [N] float64, KL(reference || model); None without a reference
    same_top1: torch.Tensor | None  # [N] bool, the model's argmax equals the reference's


@dataclass(frozen=True)
class Summary:
    positions: int
    ppl: float
    ppl_error: float  # standard error, llama-perplexity's
    kl: float | None = None
    kl_error: float | None = None
    top1: float | None = None  # fraction of positions
    top1_error: float | None = None


def score_positions(logits: torch.Tensor, next_tokens: list[int], reference: torch.Tensor | None = None
                    ) -> PositionScores:
    """Scores of rows [N, V] whose next tokens are given, against the reference's rows when there is one."""
    if reference is not None:
        logits = logits[:, : reference.shape[1]]  # a peer's vocabulary may be padded past the model's
    logp = logits.float().log_softmax(-1)
    nll = -logp.gather(1, torch.tensor(next_tokens)[:, None]).squeeze(1).double()
    if reference is None:
        return PositionScores(nll, None, None)
    ref_logp = reference.float().log_softmax(-1)
    kl = F.kl_div(logp, ref_logp, log_target=True, reduction="none").sum(-1).double()  # [N]
    return PositionScores(nll, kl, logp.argmax(-1) == ref_logp.argmax(-1))


def concat(parts: list[PositionScores]) -> PositionScores:
    has_reference = parts[0].kl is not None
    return PositionScores(torch.cat([p.nll for p in parts]),
                          torch.cat([p.kl for p in parts]) if has_reference else None,
                          torch.cat([p.same_top1 for p in parts]) if has_reference else None)


def summarize(scores: PositionScores) -> Summary:
    n = scores.nll.numel()
    ppl = math.exp(scores.nll.mean().item())
    if scores.kl is None:
        return Summary(n, ppl, ppl * _standard_error(scores.nll))
    top1 = scores.same_top1.double()
    return Summary(n, ppl, ppl * _standard_error(scores.nll), scores.kl.mean().item(), _standard_error(scores.kl),
                   top1.mean().item(), _standard_error(top1))


def _standard_error(values: torch.Tensor) -> float:
    """sqrt((E[x^2] - E[x]^2) / (N - 1)): llama-perplexity's estimate of the mean's error (0 for one value)."""
    n = values.numel()
    variance = (values.square().mean() - values.mean().square()).item()
    return math.sqrt(max(variance, 0.0) / (n - 1)) if n > 1 else 0.0


def windows(tokens: list[int], ctx: int, bos: int | None, max_windows: int | None = None) -> list[list[int]]:
    """Consecutive ctx-token windows from the start (the rest of the text is dropped), first token BOS."""
    count = len(tokens) // ctx if max_windows is None else min(len(tokens) // ctx, max_windows)
    chunks = [tokens[i * ctx : (i + 1) * ctx] for i in range(count)]
    return chunks if bos is None else [[bos] + chunk[1:] for chunk in chunks]


def score_windows(model: torch.nn.Module, dtype: torch.dtype, chunks: list[list[int]],
                  reference: torch.nn.Module | None = None,
                  kv_cache_dtype: torch.dtype | None = None,
                  kernels: KernelConfig | None = None) -> Iterator[PositionScores]:
    """Each window's scores in turn: positions ctx/2 .. ctx-2 against the window's next tokens (the layers
    planned for `kernels`; the auto K/V this tool runs never narrows attention: selection.narrow_dtype)."""
    for window in chunks:
        first = len(window) // 2
        # the last position has no next token
        logits = pagellm_logits(model, window, dtype, first=first, kv_cache_dtype=kv_cache_dtype, kernels=kernels)[:-1]
        if reference is None:
            yield score_positions(logits, window[first + 1 :])
            continue
        # the mode is the reference itself (weights, dtype and cache): KL 0, no second forward
        same = reference is model and (kv_cache_dtype or dtype) == torch.float32
        ref_logits = logits if same else pagellm_logits(reference, window, torch.float32, first=first,
                                                        kernels=kernels)[:-1]
        yield score_positions(logits, window[first + 1 :], ref_logits)


def main(args: argparse.Namespace) -> int:
    if args.ctx < 4:
        raise ValueError(f"--ctx must be >= 4 (half of each window is context, the rest is scored), got {args.ctx}")
    path = resolve_model_path(args.model)
    tokens, bos = tokenize_text(path, args.text)
    chunks = windows(tokens, args.ctx, bos, args.chunks)
    if not chunks:
        raise ValueError(f"--text {args.text} has {len(tokens)} tokens, fewer than one window of --ctx {args.ctx}")
    kernels = KernelConfig(cpu_isa=args.cpu_isa or "auto")
    backend = mode_backend(path, args.quantization, args.dtype, kernels=kernels)  # each kernel of its level built
    level = backend.level or "off"  # the full line is logged by select_kernels
    dtype, kv_dtype = backend.compute_dtype, backend.kv_cache_dtype
    model = load_mode(path, args.quantization, dtype, kernels)
    _check_context(model, args.ctx)
    reference = None
    if args.kl_base == "dense":
        reference = model if is_dense_mode(path, args.quantization, dtype) else load_dense_reference(path, kernels)
    print(f"model: {path}\nmode: {args.quantization} {str(dtype).removeprefix('torch.')}, "
          f"{str(kv_dtype).removeprefix('torch.')} KV; "
          f"kernels: {level}\n"
          f"text: {args.text}, {len(tokens)} tokens; {len(chunks)} windows of {args.ctx} "
          f"(positions {args.ctx // 2}..{args.ctx - 2} of each scored)")
    parts = []
    for i, scores in enumerate(score_windows(model, dtype, chunks, reference, kv_dtype, kernels), start=1):
        parts.append(scores)
        print(f"[{i}]{summarize(concat(parts)).ppl:.4f},", end="\n" if i == len(chunks) else "", flush=True)
    print(format_summary(summarize(concat(parts))))
    return 0


def format_summary(summary: Summary) -> str:
    lines = [f"Final estimate: PPL = {summary.ppl:.4f} +/- {summary.ppl_error:.5f} ({summary.positions} positions)"]
    if summary.kl is not None:
        lines.append(f"KL(dense fp32 || mode): mean {summary.kl:.6f} +/- {summary.kl_error:.6f}; "
                     f"top-1 agreement {100 * summary.top1:.3f} +/- {100 * summary.top1_error:.3f} %")
    return "\n".join(lines)


def _check_context(model: torch.nn.Module, ctx: int) -> None:
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if context is not None and ctx > context:
        raise ValueError(f"--ctx {ctx} is longer than the model's context of {context} tokens")
