"""`pagellm bench accuracy`: how far a mode (quantization, dtype, cpu_isa) moves a model's next-token
distributions from the dense fp32 model of the same file, beside llama.cpp's distance on the same tokens.

Per position of a real text: top-1 agreement (argmax equal to the dense model's) and KL(dense || mode), both
averaged; and the text's perplexity under each. The reference and the mode run pagellm's own forward over a
paged cache (one sequence, prefill in chunks as the engine does); llama.cpp evaluates the same token ids with
every position's logits kept. Speed ratios between modes count only beside these figures.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from pagellm.engine import DTYPES
from pagellm.kernels import native
from pagellm.loader.model_loader import load_model, resolve_model_path
from pagellm.loader.tokenizer import load_tokenizer
from pagellm.runner.attention_metadata import AttentionMetadata

_BLOCK = 16


def text_tokens(path: Path, text_file: str, positions: int) -> list[int]:
    """The first positions + 1 token ids of the text (the model's tokenizer, with its BOS)."""
    ids = load_tokenizer(path).encode(Path(text_file).read_text())
    if len(ids) < positions + 1:
        raise ValueError(f"--text {text_file} has {len(ids)} tokens, fewer than --positions {positions} + 1")
    return ids[: positions + 1]


def pagellm_logits(model: torch.nn.Module, tokens: list[int], dtype: torch.dtype, chunk: int = 128) -> torch.Tensor:
    """[len(tokens), V] fp32 logits of every position, one sequence prefilled `chunk` tokens per step."""
    if getattr(model, "state_layers", list)():
        raise ValueError("bench accuracy does not drive hybrid (recurrent-state) models yet")
    blocks = -(-len(tokens) // _BLOCK)
    for layer in model.attention_layers():
        shape = (blocks, _BLOCK, layer.num_kv_heads, layer.head_dim)
        layer.bind_kv_cache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    table, out = list(range(blocks)), []
    with torch.inference_mode():
        for start in range(0, len(tokens), chunk):
            piece = tokens[start : start + chunk]
            meta = AttentionMetadata.build([len(piece)], [start + len(piece)], [table], _BLOCK)
            hidden = model(torch.tensor(piece), torch.arange(start, start + len(piece)), meta)  # [T, E]
            out.append(model.compute_logits(hidden).float())  # [T, V]
    return torch.cat(out)


def llama_cpp_logits(path: Path, tokens: list[int], threads: int) -> torch.Tensor:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=len(tokens) + 16, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    llm.eval(tokens)
    return torch.from_numpy(llm.scores[: len(tokens)].copy()).float()


def distance(reference: torch.Tensor, logits: torch.Tensor, tokens: list[int]) -> dict[str, float]:
    """Top-1 agreement and mean KL(reference || logits) over the positions, and the text's perplexity."""
    ref_logp, logp = reference.log_softmax(-1), logits[:, : reference.shape[1]].log_softmax(-1)
    kl = F.kl_div(logp, ref_logp, log_target=True, reduction="none").sum(-1)  # [L]
    nll = -logp[:-1].gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
    return {"top1": (logp.argmax(-1) == ref_logp.argmax(-1)).float().mean().item(), "kl": kl.mean().item(),
            "ppl": math.exp(nll.mean().item())}


def main(args: argparse.Namespace) -> int:
    path = resolve_model_path(args.model)
    tokens = text_tokens(path, args.text, args.positions)
    level = native.select(args.cpu_isa or "auto")
    dtype = DTYPES[args.dtype or "float32"]
    print(f"model: {path}\ntext: {args.text}, {len(tokens)} tokens; kernels: {level}")
    dense = load_model(str(path), torch.float32, torch.device("cpu"), with_tokenizer=False).model
    reference = pagellm_logits(dense, tokens, torch.float32)
    del dense
    rows = {"pagellm dense fp32 (reference)": distance(reference, reference, tokens)}
    model = load_model(str(path), dtype, torch.device("cpu"), with_tokenizer=False,
                       quantization=args.quantization).model
    rows[f"pagellm {args.quantization} {dtype_name(dtype)} ({level})"] = distance(
        reference, pagellm_logits(model, tokens, dtype), tokens)
    del model
    if "llama.cpp" in args.peers.split(",") and path.is_file():
        rows["llama.cpp (the file as stored)"] = distance(reference, llama_cpp_logits(path, tokens, args.llama_threads),
                                                          tokens)
    print("| model | top-1 agreement | mean KL | perplexity |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['top1']:.3f} | {row['kl']:.4f} | {row['ppl']:.3f} |")
    return 0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
