"""Compile the Triton kernels (paged attention, the fused layer ops, the GGUF matmuls, the Gated DeltaNet) to
GPU machine code without a GPU: Triton's own code generator and the ptxas its wheel ships, for an NVIDIA
architecture named on the command line. The interpreter (tests/gpu) checks what the kernels compute; this that their
code generates for a GPU, with this venv's Triton and 64-bit strides (a GPU run may specialise other argument
values, and the GPU image has an older Triton).

    python -m tests.gpu.compile_for_gpus 90 80      (run in a process without TRITON_INTERPRET)
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagellm.kernels.gpu import attention as triton_attention, gated_delta, gated_delta_prefill
from pagellm.kernels.gpu import gguf_gemv_q8, gguf_matmul, moe
from pagellm.kernels.gpu import layer_ops as triton_layer_ops
from pagellm.kernels.reference.gguf_planes import FORMATS, RUNS, T

POINTERS = {"out_ptr": "q", "q_ptr": "q", "k_cache_ptr": "kv", "v_cache_ptr": "kv", "block_tables_ptr": "*i64",
            "seq_lens_ptr": "*i64", "query_start_loc_ptr": "*i64", "partial_ptr": "*fp32", "max_sum_ptr": "*fp32"}
# (query dtype, K/V dtype, query heads per kv head, head size, block size, pure decode, window, soft-cap): the
# families' shapes (Llama 3 and Qwen3 GQA 4 x 128, Gemma 3 256 with window and cap, a head size of no power of 2)
VARIANTS = [("bf16", "bf16", 4, 128, 16, True, False, False), ("bf16", "bf16", 4, 128, 16, False, False, False),
            ("bf16", "bf16", 4, 256, 16, False, True, True), ("fp32", "fp32", 1, 64, 16, False, False, False),
            ("fp16", "fp16", 3, 80, 32, True, True, False)]


def compile_variant(q_dtype, kv_dtype, group, head_dim, block_size, decode, window, cap, arch: int) -> int:
    """The size in bytes of the cubin for `arch` (e.g. 90: H100 / H200)."""
    kernel = triton_attention._paged_attention_kernel
    block_g = triton.next_power_of_2(group)
    block_m = max(16 if decode else 64, block_g)  # as paged_attention_triton chooses
    constexprs = dict(G=group, BLOCK_G=block_g, BLOCK_Q=block_m // block_g, HEAD_DIM=head_dim,
                      BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
                      TILE=triton_attention.TILE_N, USE_CAP=cap, USE_WINDOW=window,
                      DOT_PRECISION="ieee" if q_dtype == "fp32" else "tf32",
                      NUM_SPLITS=triton_attention.MAX_SPLITS if decode else 1)  # a decode split, as B=1 runs
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTERS:
            kind = POINTERS[name]
            signature[name] = {"q": f"*{q_dtype}", "kv": f"*{kv_dtype}"}.get(kind, kind)
        elif name in ("scale", "soft_cap"):
            signature[name] = "fp32"
        else:
            signature[name] = "i64" if name.startswith("stride") else "i32"
    return _cubin_size(kernel, signature, constexprs, arch)


def _cubin_size(kernel, signature: dict, constexprs: dict, arch: int, options: dict | None = None) -> int:
    source = ASTSource(kernel, signature, {(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    return len(triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["cubin"])


def compile_reduce(arch: int) -> int:
    """The split-KV reduce kernel, bf16 output of head size 128."""
    kernel = triton_attention._reduce_splits_kernel
    constexprs = dict(NUM_SPLITS=triton_attention.MAX_SPLITS, HEAD_DIM=128, BLOCK_D=128)
    signature = {name: "constexpr" if name in constexprs else "*bf16" if name == "out_ptr" else "*fp32"
                 if name.endswith("_ptr") else "i64" if name.startswith("stride") else "i32"
                 for name in kernel.arg_names}
    return _cubin_size(kernel, signature, constexprs, arch)


# (kernel, constexprs): bf16 activations, the variants the decoder layers launch (Llama 3's hidden size 2048 and
# head 128; Gemma's flavour with post-norms and gelu(tanh); qk norms of Qwen3)
LAYER_OP_VARIANTS = [
    ("_add_rms_norm_kernel", dict(HAS_X=True, HAS_POST=False, UNIT_OFFSET=False, BLOCK=2048)),
    ("_add_rms_norm_kernel", dict(HAS_X=True, HAS_POST=True, UNIT_OFFSET=True, BLOCK=1024)),
    ("_qkv_prepare_kernel", dict(H=32, K=8, HEAD_DIM=128, HALF_BLOCK=64, HAS_NORM=False, UNIT_OFFSET=False)),
    ("_qkv_prepare_kernel", dict(H=16, K=8, HEAD_DIM=128, HALF_BLOCK=64, HAS_NORM=True, UNIT_OFFSET=False)),
    ("_act_mul_kernel", dict(ACT=0, BLOCK=1024)),
    ("_act_mul_kernel", dict(ACT=1, BLOCK=1024)),
    ("_gated_rms_norm_kernel", dict(BLOCK=128)),  # the Gated DeltaNet's output norm, value heads of 128
]


def compile_layer_op(name: str, constexprs: dict, arch: int) -> int:
    """The cubin size of one fused layer op: pointers bf16 (slots int64), strides i64, eps fp32."""
    kernel = getattr(triton_layer_ops, name)
    signature = {}
    for arg in kernel.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = "*i64" if arg == "slots_ptr" else "*bf16"
        else:
            signature[arg] = "fp32" if arg == "eps" else "i64" if arg.startswith("stride") else "i32"
    return _cubin_size(kernel, signature, constexprs, arch, {"enable_fp_fusion": False})  # as they launch


# the GGUF matmuls on planes: every format's B=1 gemv; for the formats of Q4_K_M and Q8_0 files, the split gemv at
# its largest M, the tile kernel and the dequantization (bf16 activations)
GGUF_VARIANTS = [("_gemv_kernel", t, 1, True) for t in FORMATS] + [
    (kernel, t, 8, False) for t in (T.Q4_K, T.Q6_K, T.Q8_0)
    for kernel in ("_gemv_kernel", "_dot_kernel", "_dequant_kernel")] + [
    ("_gemv_q8_kernel", t, 1, True) for t in (T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0)] + [("_gemv_q8_kernel", T.Q4_K, 8, False)]
_PLANE_POINTERS = {"qs_ptr": "*u8", "qh_ptr": "*u8", "sc_ptr": "*u8", "mn_ptr": "*u8", "d_ptr": "*fp16",
                   "dm_ptr": "*fp16", "part_ptr": "*fp32", "ids_ptr": "*i64", "a_ptr": "*i8", "dx_ptr": "*fp32"}


def compile_gguf(name: str, ggml_type, block_m: int, direct: bool, arch: int) -> int:
    """The cubin size of one GGUF kernel over `ggml_type`'s planes, as BoundPlanesMatmul launches it."""
    kernel = getattr(gguf_gemv_q8 if name == "_gemv_q8_kernel" else gguf_matmul, name)
    fmt = dict(FMT=FORMATS.index(ggml_type), RUN=RUNS[ggml_type])
    if name in ("_gemv_kernel", "_gemv_q8_kernel"):
        constexprs = dict(HAS_BIAS=False, DIRECT=direct, BM=block_m, BN=gguf_matmul.GEMV_TILES[block_m][1],
                          BH=gguf_matmul.GEMV_TILES[block_m][2], **fmt)
    elif name == "_dot_kernel":
        bm, bn, bh = gguf_matmul.DOT_TILE
        constexprs = dict(HAS_BIAS=False, BM=bm, BN=bn, BH=bh, PRECISION="tf32", **fmt)
    else:
        constexprs = dict(HAS_IDS=False, BN=gguf_matmul.DEQUANT_TILE[0], BH=gguf_matmul.DEQUANT_TILE[1], **fmt)
    pointers = dict(_PLANE_POINTERS, qs_ptr="*i8" if ggml_type == T.Q8_0 else "*u8",
                    qh_ptr="*i32" if ggml_type in (T.Q5_0, T.Q5_1) else "*u8",
                    sc_ptr="*i8" if ggml_type == T.Q6_K else "*u8")
    signature = {arg: "constexpr" if arg in constexprs else pointers.get(arg, "*bf16") if arg.endswith("_ptr")
                 else "i32" for arg in kernel.arg_names}
    return _cubin_size(kernel, signature, constexprs, arch)


def compile_gguf_quantize(arch: int) -> int:
    """The int8 gemv's activation quantization, from bf16."""
    kernel = gguf_gemv_q8._quantize_kernel
    constexprs = dict(GROUPS=gguf_gemv_q8.QUANTIZE_GROUPS, ROUND=gguf_gemv_q8.ROUNDER)
    pointers = {"x_ptr": "*bf16", "q_ptr": "*i8", "d_ptr": "*fp32"}
    signature = {arg: "constexpr" if arg in constexprs else pointers.get(arg, "i32") for arg in kernel.arg_names}
    return _cubin_size(kernel, signature, constexprs, arch)


def compile_gguf_reduce(arch: int) -> int:
    kernel = gguf_matmul._reduce_kernel
    constexprs = dict(SPLITS=4, HAS_BIAS=True, BLOCK=gguf_matmul.REDUCE_BLOCK)
    signature = {arg: "constexpr" if arg in constexprs else "*fp32" if arg == "part_ptr" else "*bf16"
                 if arg.endswith("_ptr") else "i32" for arg in kernel.arg_names}
    return _cubin_size(kernel, signature, constexprs, arch)


def compile_gated_delta(arch: int) -> list[tuple[str, int]]:
    """The Gated DeltaNet kernels at Qwen3.5's shapes: the verify step's state-row copy, the decode's bf16 conv of 4
    taps and rule on 128 x 128 heads, the chunked prefill rule; both rules over fp32 and bf16 states."""
    conv = gated_delta._conv_decode_kernel
    constexprs = dict(TAPS=4, BLOCK=gated_delta.CONV_BLOCK)
    signature = {a: "constexpr" if a in constexprs else "*i64" if a == "slots_ptr" else "*bf16" if a.endswith("_ptr")
                 else "i32" for a in conv.arg_names}
    rule = gated_delta._rule_decode_kernel
    rule_constexprs = dict(DK=128, DV=128, BLOCK_K=128, BLOCK_V=gated_delta.STATE_BLOCK_V)
    rule_signature = {a: "constexpr" if a in rule_constexprs else "*i64" if a == "slots_ptr" else "*fp32"
                      if a.endswith("_ptr") else "i32" for a in rule.arg_names}
    prefill = gated_delta_prefill._chunked_rule_kernel
    prefill_constexprs = dict(DK=128, DV=128, CHUNK=64, BLOCK_K=128, BLOCK_V=gated_delta_prefill.STATE_BLOCK_V,
                              PRECISION=gated_delta_prefill.DOT_PRECISION)
    prefill_signature = {a: "constexpr" if a in prefill_constexprs else "*fp32" if a in rule.arg_names
                         and a.endswith("_ptr") or a == "out_ptr" else "*i64" if a.endswith("_ptr") else "i32"
                         for a in prefill.arg_names}
    copy = gated_delta._copy_rows_kernel
    copy_signature = {a: "constexpr" if a == "BLOCK" else "*i64" if a in ("src_ptr", "dst_ptr") else "*fp32"
                      if a == "t_ptr" else "i32" for a in copy.arg_names}
    bf16_state = {"state_ptr": "*bf16"}  # CacheConfig.mamba_ssm_cache_dtype="bfloat16"
    return [("_copy_rows_kernel", _cubin_size(copy, copy_signature, dict(BLOCK=gated_delta.COPY_BLOCK), arch)),
            ("_conv_decode_kernel", _cubin_size(conv, signature, constexprs, arch)),
            ("_rule_decode_kernel", _cubin_size(rule, rule_signature, rule_constexprs, arch)),
            ("_rule_decode_kernel bf16 state", _cubin_size(rule, rule_signature | bf16_state, rule_constexprs, arch)),
            ("_chunked_rule_kernel", _cubin_size(prefill, prefill_signature, prefill_constexprs, arch)),
            ("_chunked_rule_kernel bf16 state", _cubin_size(prefill, prefill_signature | bf16_state,
                                                            prefill_constexprs, arch))]


def compile_moe(arch: int) -> list[tuple[str, int]]:
    """The grouped MoE launch over planes as a Q4_K_M MoE runs it (gate/up Q4_K by token, down Q6_K weighted), and
    the router's top-k at Qwen3.5-35B-A3B's 256 experts."""
    kernel, sizes = moe._moe_planes_kernel, []
    # the default tile for both launches, and the sweep's largest candidate (bench/device_moe_tiles.py)
    for ggml_type, by_token, (bm, bn, bh) in ((T.Q4_K, True, (moe.BLOCK_M, *moe.TILE)),
                                              (T.Q6_K, False, (moe.BLOCK_M, *moe.TILE)), (T.Q4_K, True, (64, 128, 32))):
        constexprs = dict(BY_TOKEN=by_token, WEIGHTED=not by_token, FMT=FORMATS.index(ggml_type),
                          RUN=RUNS[ggml_type], BM=bm, BN=bn, BH=bh, PRECISION="tf32")
        pointers = dict(_PLANE_POINTERS, sc_ptr="*i8" if ggml_type == T.Q6_K else "*u8", pairs_ptr="*i64",
                        experts_ptr="*i32")
        signature = {a: "constexpr" if a in constexprs else pointers.get(a, "*bf16") if a.endswith("_ptr")
                     else "i32" for a in kernel.arg_names}
        sizes.append((f"_moe_planes_kernel {ggml_type.name} {bm}x{bn}x{bh}",
                      _cubin_size(kernel, signature, constexprs, arch)))
    router, constexprs = moe._route_kernel, dict(TOP_K=8, NORMALIZE=True, BLOCK=256)  # 256 experts, 8 a token
    signature = {a: "constexpr" if a in constexprs else "*i64" if a == "ids_ptr" else "*bf16" if a.endswith("_ptr")
                 else "i32" for a in router.arg_names}
    return sizes + [("_route_kernel", _cubin_size(router, signature, constexprs, arch))]


if __name__ == "__main__":
    for arch in map(int, sys.argv[1:]):
        for variant in VARIANTS:
            print(arch, *variant, compile_variant(*variant, arch=arch), flush=True)
        print(arch, "_reduce_splits_kernel", compile_reduce(arch), flush=True)
        for name, constexprs in LAYER_OP_VARIANTS:
            print(arch, name, compile_layer_op(name, constexprs, arch), flush=True)
        for name, ggml_type, block_m, direct in GGUF_VARIANTS:
            print(arch, name, ggml_type.name, block_m, compile_gguf(name, ggml_type, block_m, direct, arch), flush=True)
        print(arch, "_reduce_kernel", compile_gguf_reduce(arch), flush=True)
        print(arch, "_quantize_kernel", compile_gguf_quantize(arch), flush=True)
        for name, size in compile_gated_delta(arch) + compile_moe(arch):
            print(arch, name, size, flush=True)
