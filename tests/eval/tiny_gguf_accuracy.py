"""How far each compute / K-V dtype moves tiny Llama and Qwen2 GGUFs (random weights, Q4_0 / Q4_1 / Q4_K) from
the dense fp32 model of the same file, with llama.cpp on the same token ids beside: issue 34's per-mode study
on families other than the embedded Gemma (docs/benchmarks/2026-11-26-bf16-accuracy.md).

    python -m tests.eval.tiny_gguf_accuracy [--cpu-isa avx512|avx2|generic] [--positions 256] [--seeds N]

--seeds N: the no-flags default mode only, beside llama.cpp, on N files of each kind (weights drawn from seeds
1..N): one file's ratio to llama.cpp moves ~10% with its random draw, the mean over files much less.

llama.cpp is read through llama-cpp-python (LLAMA_CPP_LIB_PATH at a build of ../shared/peers/build-llama-cpp.sh);
without it its column says why. Random weights give large, peaked logits, so the KL values are far above a
trained model's; what the rows compare is each mode against the others and llama.cpp on the same file. Q4_K
blocks are random bytes (tests/loader/gguf_builders.py), unlike a converter's: read those rows with care.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import tempfile

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from pagellm.config import KernelConfig
from pagellm.eval.forward import load_dense_reference, load_mode, mode_backend, pagellm_logits
from pagellm.eval.perplexity import score_positions, summarize
from tests.loader.gguf_builders import TinyDims, write_tiny_gguf

F32, BF16 = torch.float32, torch.bfloat16
MODES = {"bf16, bf16 K/V": (BF16, BF16, None), "fp32, bf16 K/V": (F32, BF16, None), "fp32, fp32 K/V": (F32, F32, None),
         "bf16, fp32 K/V": (BF16, F32, None),
         "fp32, bf16 K/V, MLP, attention": (F32, BF16, BF16)}  # (compute, K/V, MLP and attention dtypes)
DIMS = TinyDims(n_layers=4, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, intermediate=512, context=512)
VOCAB = [f"tok{i}" for i in range(512)]
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def tiny_gguf(path: Path, arch: str, qtype: T, seed: int = 1) -> Path:
    """Every projection in `qtype`, the embedding, head and norms in F32."""
    names = [f"blk.{i}.{p}.weight" for i in range(DIMS.n_layers) for p in _PROJECTIONS]
    return write_tiny_gguf(path, arch, DIMS, types={n: qtype for n in names}, vocab=VOCAB, seed=seed).path


def default_mode(path: Path, level: str | None) -> tuple:
    """(compute, K/V, narrow) dtypes the engine runs the GGUF `path` in with no flags at `level`."""
    backend = mode_backend(path, kernels=KernelConfig(cpu_isa=level or "auto", native_kernels=level is not None))
    return backend.compute_dtype, backend.kv_cache_dtype, backend.narrow_dtype


def reference_logits(path: Path, tokens: list[int], kernels: KernelConfig) -> torch.Tensor:
    """[len(tokens), V]: the dense fp32 model of the same file (its blocks dequantized)."""
    return pagellm_logits(load_dense_reference(path, kernels), tokens, F32, kernels=kernels)


def kl_of_modes(path: Path, tokens: list[int], kernels: KernelConfig, reference: torch.Tensor,
                modes=MODES) -> dict[str, float]:
    """{mode: mean KL(reference || mode)} over the positions that have a next token."""
    out = {}
    for name, (dtype, kv, narrow) in modes.items():
        logits = pagellm_logits(load_mode(path, "auto", dtype, kernels), tokens, dtype, kv_cache_dtype=kv,
                                kernels=kernels, narrow=narrow)
        out[name] = summarize(score_positions(logits[:-1], tokens[1:], reference[:-1])).kl
    return out


def llama_cpp_kl(path: Path, tokens: list[int], reference: torch.Tensor) -> float | str:
    try:
        import llama_cpp
    except ImportError as exc:
        return f"not run ({exc})"
    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=len(tokens) + 16, n_threads=2, verbose=False)
    llm.eval(tokens)
    logits = torch.from_numpy(llm.scores[: len(tokens)].copy()).float()
    return summarize(score_positions(logits[:-1], tokens[1:], reference[:-1])).kl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-isa", default="auto")
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=0, help="the default mode on this many files of each kind")
    args = parser.parse_args()
    kernels = KernelConfig(cpu_isa=args.cpu_isa)
    tokens = np.random.default_rng(0).integers(0, len(VOCAB), args.positions + 1).tolist()
    with tempfile.TemporaryDirectory() as root:
        if args.seeds:
            default_over_seeds(Path(root), tokens, kernels, args.seeds)
            return
        print(f"| family | weights | {' | '.join(MODES)} | llama.cpp |\n|---|---|{'---|' * (len(MODES) + 1)}")
        for arch in ("llama", "qwen2"):
            for qtype in (T.Q4_0, T.Q4_1, T.Q4_K):
                path = tiny_gguf(Path(root) / f"{arch}-{qtype.name}.gguf", arch, qtype)
                reference = reference_logits(path, tokens, kernels)
                kls = kl_of_modes(path, tokens, kernels, reference)
                peer = llama_cpp_kl(path, tokens, reference)
                cells = [f"{v:.4f}" for v in kls.values()] + [peer if isinstance(peer, str) else f"{peer:.4f}"]
                print(f"| {arch} | {qtype.name} | {' | '.join(cells)} |", flush=True)


def default_over_seeds(root: Path, tokens: list[int], kernels: KernelConfig, seeds: int) -> None:
    """Per kind of file: the default's KL / llama.cpp's on each seed's file, the mean of those ratios and the
    ratio of the mean KLs; fp32 compute with fp32 K/V's mean ratio beside (what no bf16 site would give)."""
    from pagellm.kernels.selection import select_kernels

    level = select_kernels(kernels, "cpu").level
    print("| family | weights | default / llama.cpp KL per file | mean of ratios | ratio of mean KLs | "
          "fp32 compute and K/V: mean of ratios |\n|---|---|---|---|---|---|")
    for arch in ("llama", "qwen2"):
        for qtype in (T.Q4_0, T.Q4_1, T.Q4_K):
            kls: dict[str, list[float]] = {"default": [], "fp32": [], "llama.cpp": []}
            for seed in range(1, seeds + 1):
                path = tiny_gguf(root / f"{arch}-{qtype.name}-{seed}.gguf", arch, qtype, seed)
                reference = reference_logits(path, tokens, kernels)
                peer = llama_cpp_kl(path, tokens, reference)
                if isinstance(peer, str):
                    raise SystemExit(f"llama.cpp {peer}")
                modes = {"default": default_mode(path, level), "fp32": (F32, F32, None)}
                for name, kl in kl_of_modes(path, tokens, kernels, reference, modes).items():
                    kls[name].append(kl)
                kls["llama.cpp"].append(peer)
            ratios = {name: np.array(kls[name]) / np.array(kls["llama.cpp"]) for name in ("default", "fp32")}
            print(f"| {arch} | {qtype.name} | {' '.join(f'{r:.2f}' for r in ratios['default'])} | "
                  f"{ratios['default'].mean():.3f} | {np.mean(kls['default']) / np.mean(kls['llama.cpp']):.3f} | "
                  f"{ratios['fp32'].mean():.3f} |", flush=True)


if __name__ == "__main__":
    main()
