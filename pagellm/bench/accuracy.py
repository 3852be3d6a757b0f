"""`pagellm bench accuracy`: how far a mode (quantization, dtype, cpu_isa) moves a model's next-token
distributions from the dense fp32 model of the same file, beside llama.cpp's distance on the same tokens.

Per position of a real text that has a next token: top-1 agreement (argmax equal to the dense model's) and
KL(dense || mode), both averaged; and the text's perplexity under each. The reference and the mode run
pagellm's own forward over a paged cache (eval/forward.py: one sequence, prefill in chunks as the engine
does); llama.cpp evaluates the same token ids with every position's logits kept. Speed ratios between modes
count only beside these figures. `pagellm eval perplexity` scores the same way over llama-perplexity's windows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pagellm.config import KernelConfig
from pagellm.bench.llama_cpp_peer import llama_cpp_available
from pagellm.eval.forward import load_dense_reference, load_mode, mode_backend, pagellm_logits, tokenize_text
from pagellm.eval.perplexity import score_positions, summarize
from pagellm.kernels.selection import narrow_sites
from pagellm.loader.model_loader import resolve_model_path


def text_tokens(path: Path, text_file: str, positions: int) -> list[int]:
    """The first positions + 1 token ids of the text (the model's tokenizer, with its BOS)."""
    ids, _ = tokenize_text(path, text_file)
    if len(ids) < positions + 1:
        raise ValueError(f"--text {text_file} has {len(ids)} tokens, fewer than --positions {positions} + 1")
    return ids[: positions + 1]


def llama_cpp_logits(path: Path, tokens: list[int], threads: int) -> torch.Tensor:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=len(tokens) + 16, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    llm.eval(tokens)
    return torch.from_numpy(llm.scores[: len(tokens)].copy()).float()


def distance(reference: torch.Tensor, logits: torch.Tensor, tokens: list[int]) -> dict[str, float]:
    """Top-1 agreement and mean KL(reference || logits) over the positions that have a next token, and the
    text's perplexity. reference, logits: [len(tokens), V] of every position."""
    summary = summarize(score_positions(logits[:-1], tokens[1:], reference[:-1]))
    return {"top1": summary.top1, "kl": summary.kl, "ppl": summary.ppl}


def main(args: argparse.Namespace) -> int:
    path = resolve_model_path(args.model)
    tokens = text_tokens(path, args.text, args.positions)
    kernels = KernelConfig(cpu_isa=args.cpu_isa or "auto")
    # each kernel of its level built, or an error
    backend = mode_backend(path, args.quantization, args.dtype, args.kv_cache_dtype, kernels)
    level = backend.level or "off"  # the full line is logged by select_kernels
    dtype, kv_dtype, narrow = backend.compute_dtype, backend.kv_cache_dtype, backend.narrow_dtype
    print(f"model: {path}\ntext: {args.text}, {len(tokens)} tokens; kernels: {level}")
    llama_cpp = "llama.cpp" in args.peers.split(",") and path.is_file()
    why_not = llama_cpp_available() if llama_cpp else None
    if why_not is not None:  # said now, not after minutes of measuring pagellm
        print(f"llama.cpp: not run: {why_not}")
    dense = load_dense_reference(path, kernels)
    reference = pagellm_logits(dense, tokens, torch.float32, kernels=kernels)
    del dense
    rows = {"pagellm dense fp32 (reference)": distance(reference, reference, tokens)}
    model = load_mode(path, args.quantization, dtype, kernels)
    kv = "" if kv_dtype == dtype else f", {dtype_name(kv_dtype)} KV"
    kv += narrow_sites(narrow)
    rows[f"pagellm {args.quantization} {dtype_name(dtype)}{kv} ({level})"] = distance(
        reference, pagellm_logits(model, tokens, dtype, kv_cache_dtype=kv_dtype, kernels=kernels, narrow=narrow),
        tokens)
    del model
    if llama_cpp and why_not is None:
        rows["llama.cpp (the file as stored)"] = distance(reference, llama_cpp_logits(path, tokens, args.llama_threads),
                                                          tokens)
    print("| model | top-1 agreement | mean KL | perplexity |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['top1']:.3f} | {row['kl']:.4f} | {row['ppl']:.3f} |")
    return 0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
