"""The llama.cpp peer of `pagellm bench compare` and `bench accuracy`: llama.cpp through llama-cpp-python's
low-level API, as llama-batched-bench drives it: one llama_batch holding every sequence id per llama_decode call,
a KV cache large enough for every sequence, unified or per-sequence KV. It runs B prompts of PP tokens and TG
decode steps, greedy, and returns the prefill time (until every sequence has its first token) and the decode time
(TG more tokens each), exactly what pagellm's batched bench measures. No torch here: `bench compare` runs it in a
process of its own (bench/peer_process.py).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np

from pagellm.bench.peer_setup import install_hint


def llama_cpp_available() -> str | None:
    """None when llama-cpp-python imports, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from a broken shared library
        return (f"llama-cpp-python not importable ({type(exc).__name__}: {exc}); "
                + install_hint("it, with llama.cpp's tools"))
    return None


_LOG_SINK = None  # keeps the ctypes log callback alive for the life of the process


def _silence_llama_logs(llama_cpp) -> None:
    global _LOG_SINK
    if _LOG_SINK is None:
        _LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_LOG_SINK, ctypes.c_void_p(0))


class LlamaCppPeer:
    """llama.cpp on a GGUF file; `kv_unified` picks one KV buffer for all sequences or one per sequence."""

    name = "llama.cpp"

    def __init__(self, gguf_path: Path, threads: int = 2, n_batch: int = 2048, n_ubatch: int = 512):
        import llama_cpp

        self.lib = llama_cpp
        _silence_llama_logs(llama_cpp)
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {gguf_path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.threads, self.n_batch, self.n_ubatch = threads, n_batch, n_ubatch
        version = getattr(llama_cpp, "__version__", "?")
        self.description = f"llama-cpp-python {version}, {threads} threads, n_batch {n_batch}, n_ubatch {n_ubatch}"

    def close(self) -> None:
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    def _context(self, batch: int, seq_len: int, kv_unified: bool):
        lib = self.lib
        params = lib.llama_context_default_params()
        per_seq = -(-(seq_len + 1) // 256) * 256  # each sequence's share, whole KV pages
        params.n_ctx = batch * per_seq
        params.n_batch, params.n_ubatch = self.n_batch, self.n_ubatch
        params.n_seq_max = batch
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = kv_unified
        ctx = lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {batch} sequences")
        return ctx

    def run(self, prompts: list[list[int]], tg: int, kv_unified: bool) -> tuple[float, float]:
        lib = self.lib
        pp, b = len(prompts[0]), len(prompts)
        if any(len(p) != pp for p in prompts):
            raise ValueError("llama.cpp peer: prompts must have one length")
        ctx = self._context(b, pp + tg, kv_unified)
        prefill = _Batch(lib, b * pp)
        step = _Batch(lib, b)
        try:
            lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
            prefill.fill(np.array(prompts).reshape(-1), np.tile(np.arange(pp), b), np.repeat(np.arange(b), pp),
                         np.tile(np.arange(pp) == pp - 1, b))
            step.fill(np.zeros(b, dtype=np.int32), np.zeros(b, dtype=np.int32), np.arange(b), np.ones(b, dtype=bool))
            t0 = time.perf_counter()
            tokens = np.concatenate([self._decode(ctx, view) for view in prefill.views(self.n_batch)])
            t_first = time.perf_counter()
            for i in range(tg):
                step.tokens[:] = tokens
                step.positions[:] = pp + i
                tokens = self._decode(ctx, step.batch)
            t_end = time.perf_counter()
        finally:
            prefill.free()
            step.free()
            lib.llama_free(ctx)
        return t_first - t0, t_end - t_first

    def _decode(self, ctx, batch) -> np.ndarray:
        """One llama_decode; greedy next token of every row that asked for logits."""
        if self.lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed (KV cache full?)")
        n_out = int(np.count_nonzero(np.ctypeslib.as_array(batch.logits, shape=(batch.n_tokens,))))
        if n_out == 0:
            return np.zeros(0, dtype=np.int32)
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits(ctx), shape=(n_out, self.n_vocab))
        return logits.argmax(axis=1).astype(np.int32)


class _Batch:
    """A llama_batch of one sequence id per token, with numpy views of its token / position arrays."""

    def __init__(self, lib, size: int):
        self.lib = lib
        self.batch = lib.llama_batch_init(size, 0, 1)
        self.size = size
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(size,))
        self.positions = np.ctypeslib.as_array(self.batch.pos, shape=(size,))

    def fill(self, tokens, positions, seq_ids, logits) -> None:
        b = self.batch
        b.n_tokens = self.size
        self.tokens[:] = tokens
        self.positions[:] = positions
        np.ctypeslib.as_array(b.n_seq_id, shape=(self.size,))[:] = 1
        np.ctypeslib.as_array(b.logits, shape=(self.size,))[:] = logits
        for i, seq in enumerate(seq_ids.tolist()):
            b.seq_id[i][0] = seq

    def views(self, n_batch: int):
        """llama_batch views of at most n_batch tokens over this batch, as llama-batched-bench decodes."""
        lib, b = self.lib, self.batch
        for start in range(0, self.size, n_batch):
            yield lib.llama_batch(
                n_tokens=min(n_batch, self.size - start),
                token=_offset(b.token, start), embd=None, pos=_offset(b.pos, start),
                n_seq_id=_offset(b.n_seq_id, start), seq_id=_offset(b.seq_id, start),
                logits=_offset(b.logits, start))

    def free(self) -> None:
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None


def _offset(pointer, count: int):
    """pointer + count elements, as a ctypes pointer of the same type."""
    size = ctypes.sizeof(pointer._type_)
    return ctypes.cast(ctypes.cast(pointer, ctypes.c_void_p).value + count * size, type(pointer))
