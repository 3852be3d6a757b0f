"""How many KV blocks the engine gets: from device memory on a GPU, from the configured budget on a CPU.

On CUDA, as vLLM does it (`--gpu-memory-utilization`, its name and meaning): the engine may use that fraction of
the device's memory; what the weights, the largest step's activations (measured by one profiling forward, the
most tokens a step can hold) and non-torch allocations (CUDA context, cuBLAS workspaces) use is taken off it,
and the recurrent-state slots of hybrid models too; the rest is KV. Device memory is committed when allocated,
so a budget is an allocation, not an address range as on a CPU (cpu_kv_budget_bytes).

On a CPU the pool is address space whose pages become resident as blocks are written, and go back past the
prefix cache's budget (idle_budget_blocks, core/block_pool.py): its size bounds how many tokens can be live at
once, not what is resident. It is sized for the model: every sequence at once at its whole context.

Whatever the device: a pool that cannot hold one sequence of the model's context shortens max_model_len to what
it holds (logged, as llama.cpp serves the context it could allocate); one that cannot hold an explicit
max_model_len fails at start, with the figures and the ways out, rather than at the first long request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagellm.kernels.attention_metadata import AttentionMetadata
from pagellm.platform import GIB, available_memory_bytes
from pagellm.runner.model_runner import kv_cache_bytes_per_block, state_bytes_per_slot
from pagellm.runner.mtp_drafter import mtp_scratch_blocks

logger = logging.getLogger("pagellm.engine")


# Bytes per logit the sampler may hold at once beside the logits: top-k / top-p sort their [B, V] fp32 rows with
# int64 indices and take fp32 probabilities (runner/sampler.py). Not in the profiling forward, so reserved.
SAMPLER_BYTES_PER_LOGIT = 16


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory in bytes at one moment: total and free (every process), this process's torch
    allocations now, their peak since the last reset, and what torch's allocator holds."""
    total: int
    free: int
    allocated: int
    peak: int
    reserved: int

    @classmethod
    def read(cls, device: torch.device) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device),
                   torch.cuda.memory_reserved(device))


def start_measuring(device: torch.device) -> DeviceMemory:
    """Before loading: peak statistics reset, the device's state read."""
    torch.cuda.reset_peak_memory_stats(device)
    return DeviceMemory.read(device)


def kv_budget_bytes(utilization: float, before: DeviceMemory, after: DeviceMemory, reserved_elsewhere: int) -> int:
    """The KV budget of an engine allowed `utilization` of the device: what is left of it after this process's
    peak torch use since `before` (weights + the profiled step), its non-torch growth, and `reserved_elsewhere`
    (state slots allocated later, the sampler's buffers). ValueError, with the figures, when nothing is left or
    the device has less free memory than the fraction asks for."""
    requested = utilization * before.total
    if requested > before.free:  # as vLLM: what this process already holds is not counted as free
        raise ValueError(f"gpu_memory_utilization {utilization} asks for {requested / GIB:.2f} GiB of the device's "
                         f"{before.total / GIB:.2f} GiB, but only {before.free / GIB:.2f} GiB are free (other "
                         "processes hold the rest): lower gpu_memory_utilization")
    torch_peak = after.peak - before.allocated
    non_torch = max(0, (before.free - after.free) - (after.reserved - before.reserved))
    budget = int(requested - torch_peak - non_torch - reserved_elsewhere)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} ({requested / GIB:.2f} GiB) leaves no KV cache: "
                         f"weights and the largest step peak at {torch_peak / GIB:.2f} GiB, other allocations "
                         f"{non_torch / GIB:.2f} GiB, state slots and sampler buffers {reserved_elsewhere / GIB:.2f} "
                         "GiB: raise gpu_memory_utilization or lower max_num_batched_tokens")
    return budget


# On a CPU, without kv_cache_memory, the pool holds max_num_seqs sequences of max_model_len (as llama-server's -c is
# its slots times their context) but reserves at most this share of the RAM available at start: a long context may
# not fit that often (the context is then shortened to what the pool holds, fit_max_model_len).
DEFAULT_KV_RAM_SHARE = 0.25
# Without prefix_cache_memory, on a CPU: the idle resident blocks (the prefix cache) may hold this share of the
# pool, at most DEFAULT_PREFIX_CACHE_GIB. On a GPU the pool is reserved whole: the cache may use all of it.
DEFAULT_PREFIX_CACHE_SHARE = 0.125
DEFAULT_PREFIX_CACHE_GIB = 0.25


def cpu_kv_budget_bytes(kv_cache_memory: float | None, per_block: int, block_size: int, max_model_len: int,
                        max_num_seqs: int) -> int:
    """The KV pool's bytes on a CPU: kv_cache_memory GiB, else max_num_seqs sequences of max_model_len tokens,
    capped by DEFAULT_KV_RAM_SHARE of the available RAM (the choice and why are logged)."""
    if kv_cache_memory is not None:
        return int(kv_cache_memory * GIB)
    per_sequence = -(-max_model_len // block_size) * per_block
    available = available_memory_bytes()
    wanted, cap = max_num_seqs * per_sequence, int(DEFAULT_KV_RAM_SHARE * available)
    budget = min(wanted, cap)
    logger.info("KV cache: %s reserved for %s (max_num_seqs %d x max_model_len %d tokens, %s a sequence%s); "
                "pages become resident only as blocks are written; kv_cache_memory sets it", _size(budget),
                "every sequence at full length" if budget == wanted else "part of the RAM", max_num_seqs,
                max_model_len, _size(per_sequence),
                "" if budget == wanted else f": capped at {DEFAULT_KV_RAM_SHARE:.0%} of the {_size(available)} "
                "available")
    return budget


def idle_budget_blocks(prefix_cache_memory: float | None, num_blocks: int, per_block: int,
                       host_memory: bool) -> int | None:
    """How many blocks no request holds may stay resident (the prefix cache's budget; None: no limit):
    prefix_cache_memory GiB, else in host memory (Backend.host_memory) DEFAULT_PREFIX_CACHE_SHARE of the pool,
    at most DEFAULT_PREFIX_CACHE_GIB; device memory is reserved whole anyway."""
    if prefix_cache_memory is not None:
        budget = min(num_blocks, int(prefix_cache_memory * GIB // per_block))
    elif host_memory:
        budget = min(int(num_blocks * DEFAULT_PREFIX_CACHE_SHARE), int(DEFAULT_PREFIX_CACHE_GIB * GIB // per_block))
    else:
        return None
    logger.info("prefix cache: at most %s of idle KV blocks stay resident (%d blocks); past it the least "
                "recently used go back to the OS%s", _size(budget * per_block), budget,
                "" if prefix_cache_memory is not None else "; prefix_cache_memory sets it")
    return budget


@dataclass(frozen=True)
class KVPool:
    num_blocks: int
    bytes_per_block: int  # one block over every layer, K and V
    max_model_len: int  # the model's context shortened to what the pool holds, or the explicit one


def size_kv_pool(model, compute_logits, config, max_model_len: int, kv_cache_dtype: torch.dtype,
                 device: torch.device, vocab_size: int, before: DeviceMemory | None) -> KVPool:
    """The pool an engine of `config` (EngineConfig) gets: on a CPU (before None) or with kv_cache_memory from
    the configured budget; else, `before` being the device's memory before loading, from what
    gpu_memory_utilization leaves after the weights, a profiling step and the state rows."""
    cc, sc = config.cache, config.scheduler
    per_block = kv_cache_bytes_per_block(model, cc.block_size, kv_cache_dtype)
    if before is None:
        budget = cpu_kv_budget_bytes(cc.kv_cache_memory, per_block, cc.block_size, max_model_len, sc.max_num_seqs)
        flag = "kv_cache_memory"
    else:
        profile_forward(model, compute_logits, sc.max_num_batched_tokens, sc.max_num_seqs, cc.block_size,
                        kv_cache_dtype, device)
        per_slot = state_bytes_per_slot(model)
        states = 0 if per_slot == 0 else (
            (cc.state_cache_memory * GIB if cc.state_cache_memory is not None else sc.max_num_seqs * per_slot)
            + (cc.state_snapshot_memory * GIB if cc.enable_prefix_caching else 0))
        sampler = sc.max_num_seqs * vocab_size * SAMPLER_BYTES_PER_LOGIT
        budget = kv_budget_bytes(cc.gpu_memory_utilization, before, DeviceMemory.read(device), int(states) + sampler)
        flag = "gpu_memory_utilization (or give kv_cache_memory)"
    # the MTP head's scratch blocks are bound past the pool's (runner/mtp_drafter.py): the same budget holds them
    num_blocks = int(budget // per_block) - mtp_scratch_blocks(config)
    if config.model.max_model_len is None:  # the model's own context: shortened to the pool, said once
        max_model_len = fit_max_model_len(num_blocks, cc.block_size, max_model_len, per_block, flag)
    check_holds_one_sequence(num_blocks, cc.block_size, max_model_len, per_block, flag)
    return KVPool(num_blocks, per_block, max_model_len)


def check_holds_one_sequence(num_blocks: int, block_size: int, max_model_len: int, per_block: int,
                             budget_flag: str) -> None:
    """ValueError when `num_blocks` cannot hold one sequence of max_model_len tokens (`budget_flag` names the
    setting that sized the pool)."""
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens, "
            f"{_size(num_blocks * per_block)}); one sequence of max_model_len {max_model_len} needs {needed} "
            f"({_size(needed * per_block)}): raise {budget_flag} or lower max_model_len")


def fit_max_model_len(num_blocks: int, block_size: int, context: int, per_block: int, budget_flag: str) -> int:
    """The model's context, or what the pool holds when that is shorter (logged, with the setting to raise and
    the figures), as llama.cpp serves the context it could allocate; an explicit max_model_len is not shortened
    (check_holds_one_sequence refuses it instead)."""
    held = num_blocks * block_size
    if held >= context or held == 0:
        return context
    logger.warning("max_model_len %d (the model's context) shortened to %d, what the KV cache holds (%d blocks, "
                   "%s; the full context needs %s): raise %s for the full context", context, held, num_blocks,
                   _size(num_blocks * per_block), _size(-(-context // block_size) * per_block), budget_flag)
    return held


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / (1 << 20):.2f} MiB"


def profile_forward(model, compute_logits, num_tokens: int, num_logits_rows: int, block_size: int,
                    kv_cache_dtype: torch.dtype, device: torch.device) -> None:
    """One forward of `num_tokens` prompt tokens (the most a step holds) and the logits of `num_logits_rows`
    rows (the most a step samples), so the allocator's peak holds a step's activations. The KV cache is a
    scratch one the size of this step, a hybrid model's state one scratch slot: both stay bound until the
    runner binds the real ones (freeing these)."""
    attention_layers, state_layers = model.attention_layers(), list(getattr(model, "state_layers", list)())
    blocks = -(-num_tokens // block_size)
    for layer in attention_layers:
        shape = (blocks, block_size, layer.num_kv_heads, layer.head_dim)
        layer.bind_kv_cache(torch.zeros(shape, dtype=kv_cache_dtype, device=device),
                            torch.zeros(shape, dtype=kv_cache_dtype, device=device))
    for layer in state_layers:
        shapes = layer.state_shapes()
        layer.bind_state(torch.zeros((1, *shapes.conv_state), dtype=shapes.conv_dtype, device=device),
                         torch.zeros((1, *shapes.recurrent_state), dtype=shapes.recurrent_dtype, device=device))
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [list(range(blocks))], block_size, device,
                                   [0] if state_layers else None)
    with torch.inference_mode():
        hidden = model(torch.zeros(num_tokens, dtype=torch.int64, device=device),
                       torch.arange(num_tokens, device=device), meta)  # [T, E]
        rows = torch.arange(num_tokens - min(num_logits_rows, num_tokens), num_tokens, device=device)
        compute_logits(hidden[rows])  # [rows, V] fp32
