"""`pagellm bench device-check`: the one prepared run for a GPU machine, rehearsed on a CPU at tiny shapes.

GPU time comes in minutes, so everything a device session must learn is one command:

    1. parity: a tiny Llama with random weights, fp32, pagellm's forward against HF transformers' on the device
       (max |logit difference|, argmax agreement per position), and its bf16 KL from those fp32 logits beside
       HF's own bf16 (the bound: at most twice HF's);
    2. attention: the Triton paged-attention kernel against the torch reference on the device, fp32 and bf16,
       a mixed step and split-KV decodes (on a CPU only under TRITON_INTERPRET=1, fp32); the fused layer ops
       against the torch ops in bf16 (CUDA only);
    3. speed: llama-batched-bench rows (S_PP, S_TG) at real shapes built with --load-format dummy (no download),
       for pagellm and HF generate on the same weights (dynamic cache, and static cache, which transformers
       compiles itself), engines alternating;
    4. step modes (bench/device_steps.py): decode CUDA graphs and async scheduling, their greedy ids against
       eager's, the syncs per step, their rows at every shape, and a short serving run of each (on a CPU: async
       scheduling alone, and no serving run unless --serve-prompts asks).

    pagellm bench device-check --device cuda --shapes 1b,8b --npl 1,16,64 --pp 512 --tg 64 --kv-cache-memory 8 \
        --out gpu.json
    pagellm bench device-check --device cpu --shapes tiny --npl 1,2 --pp 16 --tg 4 --peers hf      (rehearsal)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from pagellm.bench import batched, device_delta, device_moe_tiles, device_steps, device_verify, peers, report
from pagellm.bench.hybrid_shapes import HYBRID_SHAPES, kv_fields, write_hybrid_shape
from pagellm.bench.report import Column
from pagellm.config import KernelConfig
from pagellm.kernels.selection import select_kernels

# Llama shapes (vocabulary cut to 32000, as the GPU notes measured them); "tiny" is for rehearsals and parity.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),
}
COLUMNS = [Column("shape", "shape"), Column("B", "B"), Column("engine", "engine"),
           Column("S_PP", "S_PP t/s", "{:.1f}"), Column("S_TG", "S_TG t/s", "{:.1f}"),
           Column("graph_replay_rate", "graph replays", "{:.2f}"),
           Column("gpu_idle_ms_per_step", "GPU idle ms/step", "{:.2f}")]


def write_shape(name: str, directory: Path) -> Path:
    """A config.json of shape `name` in `directory` (a --load-format dummy model)."""
    from transformers import LlamaConfig

    if name in HYBRID_SHAPES:
        return write_hybrid_shape(name, directory)

    LlamaConfig(**SHAPES[name], max_position_embeddings=4096, architectures=["LlamaForCausalLM"],
                tie_word_embeddings=False).save_pretrained(directory)
    return directory


def parity(device: str, directory: Path) -> dict:
    """pagellm's and HF's fp32 logits over one sequence of the tiny shape, weights redrawn in [-0.1, 0.1] (the
    dummy range would leave every logit equal to a few ulps, where a comparison shows nothing)."""
    from transformers import AutoModelForCausalLM

    from pagellm.eval.forward import pagellm_logits
    from pagellm.loader.model_loader import checkpoint_state_dict, load_model

    model = load_model(str(write_shape("tiny", directory)), torch.float32, torch.device(device),
                       with_tokenizer=False, quantization="none", load_format="dummy").model
    generator = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.uniform_(-0.1, 0.1, generator=generator)
    hf = AutoModelForCausalLM.from_config(peers.transformers_config(model.config), dtype=torch.float32,
                                          attn_implementation="eager")
    missing, unexpected = hf.load_state_dict(checkpoint_state_dict(model), strict=False)
    if missing or unexpected:
        raise ValueError(f"HF model does not match pagellm's weights: missing {missing}, unexpected {unexpected}")
    hf = hf.to(device).eval()
    tokens = torch.randint(3, SHAPES["tiny"]["vocab_size"], (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = pagellm_logits(model, tokens, torch.float32, chunk=16)  # [L, V]: prefill in chunks, as the engine
    with torch.inference_mode():
        theirs = hf(torch.tensor([tokens], device=device)).logits[0].float()
    difference = (ours - theirs).abs().max().item()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    result = {"max_abs_logit_difference": difference, "argmax_agreement": agree}
    # bf16, the CUDA default: its distance from the fp32 logits, beside HF's own bf16 on the same weights
    hf.save_pretrained(directory / "weights")  # the same weights through the real loader, planned for bf16
    model = load_model(str(directory / "weights"), torch.bfloat16, torch.device(device), with_tokenizer=False,
                       quantization="none").model
    ours_bf16 = pagellm_logits(model, tokens, torch.bfloat16, chunk=16)
    with torch.inference_mode():
        theirs_bf16 = hf.to(torch.bfloat16)(torch.tensor([tokens], device=device)).logits[0].float()
    result["bf16_kl"], result["hf_bf16_kl"] = _kl(theirs, ours_bf16), _kl(theirs, theirs_bf16)
    result["bf16_argmax_agreement"] = (ours_bf16.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    # bf16's bound: at most twice the KL of HF's own bf16 path (and 1e-4 for a KL lost in rounding noise)
    result["ok"] = difference < 1e-3 and agree == 1 and result["bf16_kl"] <= max(2 * result["hf_bf16_kl"], 1e-4)
    return result


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference || other) of the next-token distributions, [L, V] logits each."""
    log_p, log_q = reference.double().log_softmax(-1), other.double().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


def attention(device: str) -> dict:
    """The Triton kernel against the torch reference on the device, per dtype: the worst error over its bound.
    On a CPU only under TRITON_INTERPRET=1 (set before the process starts) and in fp32: the interpreter has
    no bf16."""
    on_cuda = torch.device(device).type == "cuda"
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return {"not_run": "the Triton kernel needs CUDA, or TRITON_INTERPRET=1 for its interpreter on a CPU"}
    from pagellm.kernels.attention_metadata import AttentionMetadata
    from pagellm.kernels.reference.attention import paged_attention_reference
    from pagellm.kernels.gpu.attention import paged_attention_triton

    results, generator = {}, torch.Generator().manual_seed(0)
    query_lens, seq_lens, block = [1, 37, 1, 128], [700, 37, 3001, 300], 16  # decodes, a prefill, a chunk
    heads, kv_heads = 32, 8  # a 1B Llama's
    if not on_cuda:  # the interpreter runs one program at a time: the same cases a tenth as long, a quarter the heads
        query_lens, seq_lens, heads, kv_heads = [1, 7, 1, 13], [70, 7, 301, 30], 8, 2
    tables, start = [], 0
    for length in seq_lens:
        tables.append(list(range(start, start + -(-length // block))))  # contiguous: the kernel tests shuffle
        start += len(tables[-1])
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block, device=device)
    # the two long decodes alone, their keys split 16 ways (split-KV and its reduce kernel)
    decodes = AttentionMetadata.build([1, 1], [seq_lens[2], seq_lens[0]], [tables[2], tables[0]], block,
                                      device=device)
    for dtype in (torch.float32, torch.bfloat16)[: 2 if on_cuda else 1]:
        k, v = (torch.randn(start, block, kv_heads, 128, generator=generator).to(device, dtype) for _ in range(2))
        q = torch.randn(sum(query_lens), heads, 128, generator=generator).to(device, dtype)
        for name, step, queries, splits in ((str(dtype).removeprefix("torch."), meta, q, None),
                                            (f"{str(dtype).removeprefix('torch.')} split", decodes, q[:2], 16)):
            got = paged_attention_triton(queries, k, v, step, 128**-0.5, None, None, num_splits=splits).double()
            exact = paged_attention_reference(queries.double(), k.double(), v.double(), step, 128**-0.5)
            worst = ((got - exact).abs() / _bound(exact, dtype)).max().item()
            results[name] = {"worst_error_over_bound": worst, "ok": worst <= 1.0}
    return results


def layer_ops(device: str) -> dict:
    """The fused Triton layer ops against the torch modules they replace, in bf16 on the device, at a 1B layer's
    shapes: the share of bit-equal elements (the kernels round where the torch ops round) and the worst error
    over one bf16 rounding of the largest element. CUDA only: the interpreter has no bf16 (tests/gpu runs them
    in fp32 and fp16)."""
    if torch.device(device).type != "cuda":
        return {"not_run": "bf16 Triton layer ops need CUDA (tests/gpu checks them in fp32 and fp16 on a CPU)"}
    import torch.nn.functional as F

    from pagellm.kernels.gpu import layer_ops as ops
    from pagellm.layers.norm import RMSNorm
    from pagellm.kernels.reference.layer_ops import rotary as apply_rotary_reference

    generator, bf16 = torch.Generator(device=device).manual_seed(3), torch.bfloat16
    rand = lambda *shape: torch.randn(*shape, device=device, generator=generator).to(bf16)  # noqa: E731
    norm = RMSNorm(2048, 1e-5).to(device, bf16)
    norm.weight.copy_(rand(2048) * 0.2 + 1)
    residual, x, gate_up, qkv = rand(64, 2048), rand(64, 2048), rand(64, 2 * 8192) * 3, rand(64, 48 * 128)
    angles = torch.rand(64, 64, device=device, generator=generator) * 6
    cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)
    cache = torch.zeros(8, 16, 8, 128, device=device, dtype=bf16)
    slots = torch.arange(64, device=device)
    gate, up = gate_up.chunk(2, dim=-1)
    q = ops.qkv_prepare(qkv, 32, 8, None, None, 1e-5, False, cos, sin, cache, cache.clone(), slots)
    pairs = {"add_rms_norm": (ops.add_rms_norm(residual, x, None, norm.weight, 1e-5, False)[1],
                              norm.reference(residual + x)),
             "act_mul": (ops.act_mul(gate_up, "silu"), F.silu(gate) * up),
             "qkv_prepare": (q, apply_rotary_reference(qkv[:, : 32 * 128].view(64, 32, 128), cos, sin))}
    results = {}
    for name, (got, want) in pairs.items():
        equal = (got == want).float().mean().item()
        worst = ((got.float() - want.float()).abs().max() / (2.0**-7 * want.float().abs().max())).item()
        results[name] = {"bit_equal": equal, "worst_error_over_bound": worst, "ok": equal >= 0.9 and worst <= 1.0}
    return results


def _bound(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32: 1e-5 of each element and of the largest. bf16: 2^-7 of the row's largest |output| (the kernel rounds
    the softmax weights to bf16 before P @ V, as vLLM's does, so an element's error scales with its row, not with
    itself; a correct kernel reaches ~0.8 of it, a 1% scale error ~4, in an fp16 emulation of its arithmetic)."""
    if dtype == torch.float32:
        return 1e-5 * exact.abs() + 1e-5 * exact.abs().amax()
    return 2.0**-7 * exact.abs().amax(dim=-1, keepdim=True) + 1e-30


def speed(args: argparse.Namespace, shape: str, directory: Path) -> list[dict]:
    """llama-batched-bench rows of each engine at one shape (its config.json in `directory`, write_shape's):
    medians of --repeats, engines alternating."""
    engine = batched.build_engine(str(directory), args.dtype, max(args.npl), args.pp, args.tg,
                                  kv_cache_memory=args.kv_cache_memory or kv_gib(shape, args), device=args.device,
                                  load_format="dummy", mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                                  **device_steps.MODES["eager"])
    try:
        runners, model, state = {}, None, device_steps.state_dtype_of(engine)
        if "eager" in args.modes:
            runners["pagellm-eager"] = functools.partial(batched.timed_run, engine)
        for peer in args.peers:
            hf = peers.HFTransformersPeer(engine, static=peer == "hf-static", model=model)
            runners[hf.name], model = hf.run, hf.model  # one HF model on pagellm's tensors serves both peers
        rng, vocab = random.Random(args.seed), engine.hf_config.vocab_size
        figures = alternated(args, shape, runners, vocab, rng)
        idle = {b: device_steps.gpu_idle_ms_per_step(engine, batched.random_prompts(rng, b, args.pp, vocab, False),
                                                     args.tg) for b in args.npl if "eager" in args.modes}
    finally:
        engine.shutdown()
    return [{"shape": shape, "B": b, "engine": name, "PP": args.pp, "TG": args.tg, **figure,
             "state": state if name == "pagellm-eager" else None,  # HF's runs its own
             "gpu_idle_ms_per_step": idle.get(b) if name == "pagellm-eager" else None}
            for (name, b), figure in figures.items()]


def alternated(args: argparse.Namespace, shape: str, runners: dict, vocab: int,
               rng: random.Random) -> dict[tuple[str, int], dict]:
    """{(runner, B): median S_PP and S_TG} of --repeats rounds, the runners ((prompts, tg) -> (t_pp, t_tg))
    alternating on the same prompts, after a warm-up at every B (compilations and captures stay out)."""
    for b in args.npl:
        for run in runners.values():
            run(batched.random_prompts(rng, b, args.pp, vocab, False), args.tg)
    rows = {}
    for _ in range(args.repeats):
        for b in args.npl:
            prompts = batched.random_prompts(rng, b, args.pp, vocab, False)
            for name, run in runners.items():
                row = batched.batched_row(args.pp, args.tg, b, *run(prompts, args.tg))
                rows.setdefault((name, b), []).append(row)
                print(f"  {shape} B={b} {name}: S_PP {row['S_PP']:.1f} S_TG {row['S_TG']:.1f}", file=sys.stderr)
    return {key: {k: statistics.median(r[k] for r in runs) for k in ("S_PP", "S_TG")} for key, runs in rows.items()}


def kv_gib(shape: str, args: argparse.Namespace) -> float:
    """The KV budget the largest batch needs at this shape, 10% spare (the host-RAM default is for CPUs)."""
    return kv_gib_for(kv_fields(shape) if shape in HYBRID_SHAPES else SHAPES[shape], args)


def kv_gib_for(config: dict, args: argparse.Namespace) -> float:
    """kv_gib of a Llama config (HF field names)."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4  # K and V, <= fp32
    return 1.1 * per_token * max(args.npl) * (args.pp + args.tg + 16) / 2**30


def main(args: argparse.Namespace) -> int:
    unknown = [s for s in [*args.shapes, args.serve_shape or "1b", args.verify_shape or "1b"]
               if s not in SHAPES and s not in HYBRID_SHAPES]
    if unknown:
        raise ValueError(f"--shapes: unknown shape(s) {unknown}; known: {', '.join([*SHAPES, *HYBRID_SHAPES])}")
    if args.delta_prefill_shape not in (None, *HYBRID_SHAPES):
        raise ValueError(f"--delta-prefill-shape: {args.delta_prefill_shape!r} is not a hybrid shape "
                         f"({', '.join(HYBRID_SHAPES)})")
    moe_shapes = [name for name, fields in HYBRID_SHAPES.items() if "num_experts" in fields]
    if args.moe_tiles_shape not in (None, *moe_shapes):
        raise ValueError(f"--moe-tiles-shape: {args.moe_tiles_shape!r} is not a hybrid MoE shape "
                         f"({', '.join(moe_shapes)})")
    if set(args.modes) - set(device_steps.MODES):
        raise ValueError(f"--modes: unknown mode(s) {sorted(set(args.modes) - set(device_steps.MODES))}; "
                         f"known: {', '.join(device_steps.MODES)}")
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"]
    if set(args.peers) - {"hf", "hf-static"}:
        raise ValueError(f"--peers: unknown peer(s) {sorted(set(args.peers) - {'hf', 'hf-static'})}; "
                         "known: hf, hf-static")
    select_kernels(KernelConfig(), args.device)  # builds and checks the CPU kernels (none for a GPU)
    print(f"device: {args.device} ({torch.cuda.get_device_name(args.device) if 'cuda' in args.device else 'CPU'}), "
          f"torch {torch.__version__}")
    result = {"device": args.device, "torch": torch.__version__, "checks": {}, "rows": [], "errors": {},
              "settings": {k: getattr(args, k) for k in ("npl", "pp", "tg", "repeats", "dtype", "peers")}}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_checks:
            result["checks"] = checks(args.device, Path(tmp) / "parity")
        shape_checks(args, result, Path(tmp))
        for shape in args.shapes:
            try:
                write_shape(shape, Path(tmp) / shape)  # every engine of the shape reads it
                measured = [*speed(args, shape, Path(tmp) / shape)] if "eager" in args.modes or args.peers else []
                saved = len(result["rows"])
                result["rows"] += measured
                if args.out:
                    report.write_json(args.out, result)

                def keep(rows, before=saved + len(measured)):  # after every mode: a run cut short keeps its rows
                    result["rows"][before:] = rows
                    if args.out:
                        report.write_json(args.out, result)
                device_steps.speed_rows(args, shape, Path(tmp) / shape, args.kv_cache_memory or kv_gib(shape, args),
                                        result["errors"], keep)
            except Exception as e:  # noqa: BLE001 - one shape's failure (memory, say) must not lose the others
                result["errors"][shape] = f"{type(e).__name__}: {e}"
                print(f"{shape}: not measured: {result['errors'][shape]}", file=sys.stderr)
            if args.out:  # after every shape: a later failure leaves what was measured
                report.write_json(args.out, result)
        serve_prompts = args.serve_prompts if args.serve_prompts is not None else 32 * ("cuda" in args.device)
        if serve_prompts:
            args.serve_prompts = serve_prompts
            shape = args.serve_shape or next((s for s in args.shapes if s in SHAPES), "1b")
            model = device_steps.serving_model(write_shape(shape, Path(tmp) / "serve"))
            result["serving"] = device_steps.serving(args, model)
            if args.out:
                report.write_json(args.out, result)
    print(report.format_table(result["rows"], COLUMNS))
    found = result["checks"]
    serving_failed = any("error" in r or r.get("failed") or not 400 <= r.get("too_long_status", 400) < 500
                         for r in result.get("serving", {}).values())
    failed = serving_failed or not found.get("parity", {"ok": True})["ok"] or not all(
        found.get(check, {}).get("ok", True) for check in ("verify_cost", "delta_prefill")) or any(
        not r.get("ok", True) for check in ("attention", "layer_ops", "step_modes")
        for r in found.get(check, {}).values() if isinstance(r, dict))
    return 1 if failed or result["errors"] else 0


def shape_checks(args: argparse.Namespace, result: dict, directory: Path) -> None:
    """The checks asked by shape, each into result["checks"], written as it goes: the verify step against a
    decode step (both replayed), the Gated DeltaNet prefill (ours, torch's, fla-core's), the MoE launches' tiles
    (printed as moe_tiles.json entries)."""
    def keep(name):
        def kept(found):
            result["checks"][name] = found
            if args.out:
                report.write_json(args.out, result)
        return kept
    if args.verify_shape:
        result["checks"]["verify_cost"] = device_verify.verify_cost(
            args, write_shape(args.verify_shape, directory / "verify"))
        print(f"verify step against decode step (B=1): {result['checks']['verify_cost']}")
    if args.delta_prefill_shape:
        keep("delta_prefill")(delta_prefill(args.delta_prefill_shape, args.device, keep("delta_prefill")))
    if args.moe_tiles_shape:
        keep("moe_tiles")(device_moe_tiles.sweep(args.moe_tiles_shape, args.device, keep("moe_tiles")))
        print("moe_tiles.json entries:", json.dumps(result["checks"]["moe_tiles"]["entries"]))


def delta_prefill(shape: str, device: str, keep=None) -> dict:
    """bench/device_delta.py's rows at a hybrid shape, with "ok": the Triton kernel ran and is within fp32's reach
    of torch."""
    found = device_delta.prefill_costs(shape, device, keep=keep)
    numerics = found["numerics"]
    found["ok"] = "triton" in numerics and numerics["triton"]["out"] <= 1e-3 * max(1.0, numerics["magnitude"])
    print(f"gated delta prefill numerics (largest difference from torch): {numerics}")
    return found


def checks(device: str, directory: Path) -> dict:
    """Parity with HF, the Triton kernels against their references, and each step mode's greedy ids, printed."""
    found = {"parity": parity(device, directory), "attention": attention(device), "layer_ops": layer_ops(device)}
    try:
        found["step_modes"] = device_steps.same_ids(device, directory / "weights")
    except Exception as e:  # noqa: BLE001 - the speed rows still say what they can
        found["step_modes"] = {"eager": {"ok": False, "error": f"{type(e).__name__}: {e}"}}
    print(f"parity (tiny Llama, pagellm vs HF fp32 on {device}): {found['parity']}")
    print(f"attention (Triton vs reference): {found['attention']}")
    print(f"layer ops (Triton vs torch, bf16): {found['layer_ops']}")
    print(f"step modes (greedy ids against eager): {found['step_modes']}")
    return found
