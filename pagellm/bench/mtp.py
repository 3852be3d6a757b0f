"""`pagellm bench mtp`: speculative decoding from a hybrid model's MTP head (method mtp), what it costs and what it
can give, at a real shape on this machine.

No trained Qwen3.5 weights reach this machine, and random ones make a head that never agrees with its model. So
the bench loads the shape with --load-format dummy weights and one MTP layer, and for the runs that bound what
the head can give, makes the head predict the model in place before the first step: every block's output
projection zero (the model's next token then a function of its current one) and the head's fc [I | 0] after the
same norms. Its drafts are then accepted, all but rounding ties (the acceptance column checks it). The random
head as drawn misses every draft: with a fixed draft length that is the floor (every draft verified in vain),
with the adaptive default the cost that stays once drafting stops (the head still catches up on every token).
The arithmetic is the shape's with any weights; only the acceptance is chosen (but for MoE: such a model's greedy
text soon cycles, so a verify step's tokens may share experts more often than a trained model's would). Runs
alternate in rounds; each is a fresh engine.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
from pathlib import Path

import torch

from pagellm.bench.batched import build_engine, measure
from pagellm.bench.hybrid_shapes import write_hybrid_shape
from pagellm.config import SpeculativeConfig

_OUTPUTS = ("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")


def write_config(shape: str, directory: Path) -> Path:
    """The shape's config.json with one MTP layer (Qwen3.5's published configs name one)."""
    from transformers import AutoConfig

    write_hybrid_shape(shape, directory)
    config = AutoConfig.from_pretrained(directory)
    config.mtp_num_hidden_layers = 1
    config.save_pretrained(directory)
    return directory


@torch.no_grad()
def make_head_predict_the_model(engine) -> int:
    """In place, before the first step: every block's output projection zero (the kernels and any captured
    graph read these very tensors), the head's fc [I | 0], its embedding norm a weight of 1 and its final norm
    the model's, then the head planned again (its norms' fp32 copies are made when it is planned). Returns the
    tensors zeroed."""
    model, zeroed = engine.model, 0
    for name, parameter in model.named_parameters():
        if name.endswith(_OUTPUTS) and not name.startswith("mtp.fc"):
            parameter.zero_()
            zeroed += 1
    head = model.mtp
    hidden = head.fc.weight.shape[0]
    head.fc.weight.zero_()
    head.fc.weight[:, :hidden] = torch.eye(hidden, dtype=head.fc.weight.dtype, device=head.fc.weight.device)
    # new tensors, not writes into the old: a norm's fp32 copy is kept per tensor (layers/norm.py)
    head.pre_fc_norm_embedding.weight.data = torch.zeros_like(head.pre_fc_norm_embedding.weight)  # a weight of 1
    head.norm.weight.data = model.model.norm.weight.detach().clone()
    engine.runner.mtp.replan(engine.runner.plan_settings)
    return zeroed


def runs(ks: list[int]) -> list[tuple[str, SpeculativeConfig | None, bool]]:
    """(name, speculative config, the predicting head) of every run of a round."""
    made = [("plain", None, True)]
    made += [(f"mtp k={k}", SpeculativeConfig(method="mtp", num_speculative_tokens=k, adaptive=False), True)
             for k in ks]
    made += [("mtp k=1, head misses, adaptive", SpeculativeConfig(method="mtp"), False),
             ("mtp k=1, head misses, fixed", SpeculativeConfig(method="mtp", adaptive=False), False)]
    return made


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as directory:
        rows = _rounds(args, write_config(args.shape, Path(directory)))
    summary = _summary(rows, args.npl)
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "pp": args.pp, "tg": args.tg, "device": args.device,
                                        "rows": rows, "summary": summary}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def _rounds(args: argparse.Namespace, directory: Path) -> list[dict]:
    rows = []
    for round_index in range(args.rounds):
        for name, spec, hits in runs(args.k):
            engine = build_engine(str(directory), args.dtype, max(args.npl), args.pp, args.tg + 1, speculative=spec,
                                  kv_cache_memory=args.kv_cache_memory, load_format="dummy", device=args.device)
            if spec is not None and hits:
                make_head_predict_the_model(engine)  # in bf16, normalising twice rounds: a few ties flip
            try:
                for b in args.npl:
                    before = engine.stats()
                    row, _ = measure(engine, args.pp, args.tg, b, False, random.Random(args.seed))
                    after = engine.stats()
                    drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"]
                    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
                    verifies = after["spec_verify_steps"] - before["spec_verify_steps"]
                    rows.append({"run": name, "round": round_index, "B": b, "S_TG": row["S_TG"],
                                 "S_PP": row["S_PP"], "acceptance": accepted / drafts if drafts else None,
                                 "tokens_per_verify": 1 + accepted / verifies if verifies else None})
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                engine.shutdown()
                del engine
                gc.collect()
    return rows


def _summary(rows: list[dict], npl: list[int]) -> list[dict]:
    """Each run's median S_TG per B over the rounds, and its ratio to plain's."""
    out = []
    print("| run | B | S_TG tok/s | vs plain | acceptance | tok/verify |\n|---|---|---|---|---|---|")
    for b in npl:
        plain = statistics.median(r["S_TG"] for r in rows if r["B"] == b and r["run"] == "plain")
        for name in dict.fromkeys(r["run"] for r in rows):
            mine = [r for r in rows if r["B"] == b and r["run"] == name]
            s_tg = statistics.median(r["S_TG"] for r in mine)
            acceptance = [r["acceptance"] for r in mine if r["acceptance"] is not None]
            per_verify = [r["tokens_per_verify"] for r in mine if r["tokens_per_verify"] is not None]
            row = {"run": name, "B": b, "S_TG": s_tg, "vs_plain": s_tg / plain,
                   "acceptance": statistics.median(acceptance) if acceptance else None,
                   "tokens_per_verify": statistics.median(per_verify) if per_verify else None}
            out.append(row)
            cells = [f"{row['acceptance']:.2f}" if acceptance else "-",
                     f"{row['tokens_per_verify']:.2f}" if per_verify else "-"]
            print(f"| {name} | {b} | {s_tg:.1f} | {s_tg / plain:.2f}x | {cells[0]} | {cells[1]} |")
    return out
