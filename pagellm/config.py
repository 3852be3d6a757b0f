"""Engine configuration: frozen dataclasses, validated at construction.

Each field carries its help text in `metadata["help"]` so the CLI derives its
flags from these classes. `from_dict` rejects unknown keys by name, so a typo
in a config never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

QUANTIZATION_SCHEMES = ("none", "int8", "int4", "auto")
LOAD_FORMATS = ("auto", "dummy")
CPU_ISAS = ("auto", "avx512", "avx2", "generic")


def _help(text: str, **kwargs) -> Any:
    return field(metadata={"help": text}, **kwargs)


class _FromDict:
    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**values)


@dataclass(frozen=True)
class ModelConfig(_FromDict):
    model: str | None = _help(
        "GGUF file or HF checkpoint directory; empty means the embedded Gemma 3 270M Q4_K_M.", default=None
    )
    dtype: str | None = _help(
        "Compute dtype: float32, bfloat16, float16 or auto (the default): on CUDA bfloat16 (float16 on a GPU "
        "without bf16); on CPU float32 for a GGUF run as stored (attention in bfloat16 at avx512 only over a "
        "bfloat16 --kv-cache-dtype), else bfloat16 where the kernel level has a native bf16 dot product (avx512) and "
        "float32 elsewhere.", default=None)
    max_model_len: int | None = _help("Longest sequence served (default: the model's context length).", default=None)
    device: str = _help("torch device to run on.", default="cpu")
    quantization: str = _help(
        "Weights kept quantized in memory: auto (the default; GGUF: every tensor as the file stores it, in its "
        "own block format, on a CPU or a GPU; HF checkpoint: none) | none (a GGUF dequantized to the compute "
        "dtype) | int8 (per-row, CPU only) | int4 (group 32, CPU only). Linear layers and the token table / LM head.",
        default="auto",
    )

    enforce_eager: bool | None = _help(
        "Run every step eagerly, without CUDA graphs (vLLM's flag). Unset: on CUDA the pure-decode steps replay "
        "graphs captured at start where the model allows it (one device, a dense or sliding-window attention "
        "model; a capture that fails falls back to eager with a warning), elsewhere eager. --no-enforce-eager "
        "insists on them (CUDA only; a failed capture is then an error). MoE and recurrent-state models and "
        "tensor parallel have no decode graphs yet: they run eagerly either way.",
        default=None)
    cuda_graph_sizes: tuple[int, ...] = _help(
        "Batch sizes the decode graphs are captured at (on CUDA, unless --enforce-eager): a decode step of B "
        "requests runs at the smallest size >= B, a larger one eagerly; sizes above max_num_seqs are dropped. "
        "Empty (the default): 1, 2, 4, then every 8 up to max_num_seqs, as vLLM captures.", default=())
    cache_dir: str = _help(
        "Where what is derived from a model file at load (its converted tokenizer, a GGUF's blocks in the "
        "kernels' layout) is kept for the next start, keyed by the file; empty: nothing is kept. Default: $PAGELLM_CACHE_DIR, else $XDG_CACHE_HOME/pagellm, else "
        "~/.cache/pagellm.", default_factory=lambda: _default_cache_dir())
    load_format: str = _help(
        "How weights load: auto (the default: the checkpoint's own) | dummy (random weights from the model's "
        "config, vLLM's name and meaning: to run and measure a shape without its weights; the tokenizer is "
        "loaded where the model has one, else prompts must be token ids).", default="auto")

    def __post_init__(self):
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.quantization not in QUANTIZATION_SCHEMES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_SCHEMES)}, got {self.quantization!r}")
        if self.dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):  # runner/backend.DEVICE_KINDS
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        sizes = tuple(sorted(set(self.cuda_graph_sizes)))
        if any(not isinstance(size, int) or size < 1 for size in sizes):
            raise ValueError(f"cuda_graph_sizes must be integers >= 1, got {list(self.cuda_graph_sizes)}")
        object.__setattr__(self, "cuda_graph_sizes", sizes)  # a list from a config file or the CLI, ascending
        if self.enforce_eager is False and self.device.split(":")[0] != "cuda":
            raise ValueError(f"enforce_eager=False captures CUDA graphs; device {self.device!r} has none")
        if sizes and (self.enforce_eager or self.device.split(":")[0] != "cuda"):
            raise ValueError("cuda_graph_sizes are the decode graphs' sizes: they need a CUDA device and no "
                             "enforce_eager")


STATE_DTYPES = ("auto", "float32", "bfloat16")  # CacheConfig.mamba_ssm_cache_dtype's values
DEFAULT_SNAPSHOT_INTERVAL = 64  # tokens; measured: docs/benchmarks/2026-11-29-qwen35-gguf-cpu.md


@dataclass(frozen=True)
class CacheConfig(_FromDict):
    block_size: int = _help("Tokens per KV block.", default=16)
    kv_cache_memory: float | None = _help(
        "KV cache budget in GiB (default on a CPU: max_num_seqs sequences of max_model_len tokens, at most a "
        "quarter of the RAM available at start; on a GPU: from gpu_memory_utilization). On a CPU it is reserved address "
        "space: pages become resident as blocks are written, and blocks no request holds stay resident only "
        "within prefix_cache_memory.",
        default=None,
    )
    prefix_cache_memory: float | None = _help(
        "GiB of KV blocks no request holds that stay resident: the prefix cache, least recently used out first "
        "(llama-server's --cache-ram plays this part, in MiB). Past it blocks lose their cached prefix and, on a "
        "CPU, their pages go back to the OS (hybrid models' state snapshots with them). Default on a CPU: an "
        "eighth of the KV cache, at most 0.25 GiB; on a GPU: the whole KV cache, which is reserved anyway. 0 keeps "
        "no idle block.",
        default=None,
    )
    gpu_memory_utilization: float = _help(
        "On a GPU: the fraction of the device's memory this engine may use (vLLM's meaning). Weights, the largest "
        "step's activations (measured by a profiling forward at start) and other allocations come off it; the "
        "rest is the KV cache. Ignored when kv_cache_memory is given, and on a CPU.", default=0.9)
    enable_prefix_caching: bool = _help("Share KV blocks of identical prefixes across requests.", default=True)
    kv_cache_dtype: str = _help(
        "dtype K/V are stored in: auto (the default), float32, bfloat16 or float16. auto is the compute dtype, "
        "except a 16-bit type under an auto-chosen float32 on CPU: float16 for a GGUF run as stored (llama.cpp's "
        "default cache type), bfloat16 for an HF checkpoint; attention then reads half the bytes per step while "
        "the rest stays float32. An explicit dtype keeps its own cache.",
        default="auto")
    state_cache_memory: float | None = _help(
        "Hybrid models: GiB for recurrent-state slots, one per running request, apart from the KV budget "
        "(default: enough for max_num_seqs requests).",
        default=None,
    )
    mamba_ssm_cache_dtype: str = _help(
        "Hybrid models: dtype the Gated DeltaNet's recurrent state is kept in between steps (vLLM's flag): auto "
        "(the default: the checkpoint's mamba_ssm_dtype where its config names one, else float32, as llama.cpp "
        "and SGLang keep it), float32 or bfloat16. bfloat16 halves the state's memory and the bytes a decode "
        "step moves; the rule still computes in float32, rounding the state once per step (docs/PERFORMANCE.md "
        "has its accuracy). The conv state stays in the model dtype.",
        default="auto")
    state_snapshot_memory: float = _help(
        "Hybrid models: GiB for recurrent-state snapshots taken at KV block boundaries during prefill, which "
        "prefix caching restores on a hit (LRU-evicted like KV blocks; at most one per KV block). "
        "0 turns prefix caching off for these models.",
        default=1.0,
    )

    state_snapshot_interval: int | None = _help(
        "Hybrid models: tokens between the state snapshots of a prompt, a multiple of block_size (besides one at "
        "its last full block, where a chat's next turn branches off). A prefix hit resumes at the last snapshot "
        "within it. Default: 64 tokens (the block size where larger); a snapshot at every block slows prefill "
        "(docs/PERFORMANCE.md).", default=None)

    def snapshot_interval(self) -> int:
        """state_snapshot_interval, or its default."""
        return self.state_snapshot_interval or max(DEFAULT_SNAPSHOT_INTERVAL, self.block_size)

    def __post_init__(self):
        if self.state_cache_memory is not None and self.state_cache_memory <= 0:
            raise ValueError(f"state_cache_memory must be > 0 GiB, got {self.state_cache_memory}")
        if self.state_snapshot_memory < 0:
            raise ValueError(f"state_snapshot_memory must be >= 0 GiB, got {self.state_snapshot_memory}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.state_snapshot_interval is not None and (
                self.state_snapshot_interval < 1 or self.state_snapshot_interval % self.block_size):
            raise ValueError(f"state_snapshot_interval must be a positive multiple of block_size {self.block_size}, "
                             f"got {self.state_snapshot_interval}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if self.prefix_cache_memory is not None and self.prefix_cache_memory < 0:
            raise ValueError(f"prefix_cache_memory must be >= 0 GiB, got {self.prefix_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.mamba_ssm_cache_dtype not in STATE_DTYPES:
            raise ValueError(f"mamba_ssm_cache_dtype must be one of {', '.join(STATE_DTYPES)}, got "
                             f"{self.mamba_ssm_cache_dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig(_FromDict):
    max_num_seqs: int = _help("Most requests running at once.", default=64)
    max_num_batched_tokens: int = _help(
        "Token budget T of one step: decodes claim theirs first, prefill gets max(n_ubatch, T - decodes).",
        default=2048,
    )
    n_ubatch: int = _help("Prefill tokens always admitted per step even under heavy decode load.", default=64)
    decode_stable_interval: int = _help(
        "Opt-in decode-stable mode: with decodes running, admit prefill only every K steps (0 = off).", default=0
    )
    async_scheduling: bool | None = _help(
        "Schedule and launch each step while the previous one runs on the device, its decodes fed the tokens "
        "still on their way (vLLM's flag). The same greedy ids; a request that stops costs one dropped token. "
        "Steps of requests with penalties or structured output wait as before. Unset: on where the decode steps "
        "replay CUDA graphs, off elsewhere (an eager step keeps the host busy, and on a CPU nothing overlaps: "
        "docs/PERFORMANCE.md). Not with tensor parallel.",
        default=None)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "n_ubatch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_stable_interval < 0:
            raise ValueError(f"decode_stable_interval must be >= 0, got {self.decode_stable_interval}")


@dataclass(frozen=True)
class ParallelConfig(_FromDict):
    tensor_parallel_size: int = _help(
        "Ranks the model is split over (torch.distributed; Gloo on CPU). 1 = one process.", default=1)
    enable_expert_parallel: bool = _help(
        "MoE models: shard whole experts over the ranks instead of splitting every expert's matrices.",
        default=False)
    spawn_workers: bool = _help(
        "Start the worker ranks as local processes; with --no-spawn-workers the head waits for "
        "`pagellm worker` processes (e.g. on other hosts) to join master-addr:master-port.", default=True)
    master_addr: str = _help("Address the head listens on for its workers.", default="127.0.0.1")
    master_port: int = _help("Port the head listens on (0: a free port; needs spawn_workers).", default=0)
    distributed_timeout: float = _help(
        "Seconds a collective may wait before a rank is declared dead or hung.", default=60.0)
    join_timeout: float = _help("Seconds to wait for workers to join and load the model.", default=600.0)

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_timeout <= 0 or self.join_timeout <= 0:
            raise ValueError("distributed_timeout and join_timeout must be > 0 seconds")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}")
        if self.master_port == 0 and not self.spawn_workers and self.tensor_parallel_size > 1:
            raise ValueError("master_port must be set when workers join from elsewhere (spawn_workers=False)")


def _default_cache_dir() -> str:
    """ModelConfig.cache_dir's default, read from the environment here only (then it travels in the config)."""
    if "PAGELLM_CACHE_DIR" in os.environ:
        return os.environ["PAGELLM_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagellm")


def _env_switch(name: str) -> bool:
    """A kernel switch's default: on unless the environment variable `name` is "0". The one place such
    variables are read; the value then travels in the config (to worker ranks too)."""
    return os.environ.get(name, "1") != "0"


@dataclass(frozen=True)
class KernelConfig(_FromDict):
    cpu_isa: str = _help(
        "Instruction-set level of the native CPU kernels: auto (the fastest this CPU runs) | avx512 (AVX-512 "
        "with BF16 and VNNI) | avx2 (AVX2 + FMA) | generic (plain C++). Default: $PAGELLM_CPU_ISA or auto.",
        default_factory=lambda: os.environ.get("PAGELLM_CPU_ISA") or "auto")  # set but empty: auto
    native_kernels: bool = _help(
        "Use the C++ CPU kernels (off: torch's reference ops everywhere). Default: on unless PAGELLM_NATIVE=0.",
        default_factory=lambda: _env_switch("PAGELLM_NATIVE"))
    bound_layers: bool = _help(
        "Run decoder layers bound once to their kernels (off: the torch modules, same results). "
        "Default: on unless PAGELLM_BOUND_LAYERS=0.", default_factory=lambda: _env_switch("PAGELLM_BOUND_LAYERS"))
    int8_activations: bool = _help(
        "int4 layers quantize their activations to int8 per 32-column group (llama.cpp's Q8_0) for integer dot "
        "products (off: bf16 activations). Default: on unless PAGELLM_INT8_ACTIVATIONS=0.",
        default_factory=lambda: _env_switch("PAGELLM_INT8_ACTIVATIONS"))
    heap_tuning: bool = _help(
        "Keep a step's large buffers in glibc's heap instead of fresh mmaps (process-wide mallopt). "
        "Default: on unless PAGELLM_HEAP_TUNING=0.", default_factory=lambda: _env_switch("PAGELLM_HEAP_TUNING"))

    def __post_init__(self):
        if self.cpu_isa not in CPU_ISAS:
            raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISAS)}, got {self.cpu_isa!r}")


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig(_FromDict):
    """vLLM's --speculative-config keys (those pagellm runs), plus the adaptive switches."""

    method: str = _help("How tokens are proposed: ngram (prompt lookup over the request's own tokens) | draft_model "
                        "(greedy tokens of a smaller model of the same vocabulary: `model`) | mtp (greedy tokens of "
                        "the checkpoint's multi-token-prediction head: Qwen3-Next, Qwen3.5).", default="ngram")
    num_speculative_tokens: int | None = _help("Most tokens proposed per request and step (k). Default: 16; mtp 1, "
                                               "as vLLM (each more is one more pass of the head).", default=None)
    prompt_lookup_min: int = _help("Shortest suffix n-gram looked up.", default=2)
    prompt_lookup_max: int = _help("Longest suffix n-gram looked up (the longest with a match wins).", default=4)
    disable_by_batch_size: int = _help(
        "No speculation in a step with more decoding requests than this: verifying k tokens each then costs "
        "more than it saves (vLLM's key).", default=8)
    adaptive: bool = _help(
        "Each request's draft length follows its measured acceptance (off: always num_speculative_tokens).",
        default=True)
    draft_token_cost: float = _help(
        "What one more verified token costs relative to a one-token decode step, for the adaptive draft length "
        "(measured: docs/PERFORMANCE.md).", default=0.05)
    sampled_row_cost: float = _help(
        "What sampling one more row costs relative to a decode step, added to draft_token_cost for a request that "
        "samples (temperature > 0: a softmax and a draw over the vocabulary per draft; measured: "
        "docs/PERFORMANCE.md).", default=0.25)
    model: str | None = _help("The draft model's GGUF file or HF directory (method draft_model).", default=None)

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method {self.method!r} is not supported; supported: "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if (self.model is not None) != (self.method == "draft_model"):
            raise ValueError("speculative_config.model names the draft model of method draft_model, and only it")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", 1 if self.method == "mtp" else 16)
        if not isinstance(k := self.num_speculative_tokens, int) or not 1 <= k <= 64:
            raise ValueError(f"speculative_config.num_speculative_tokens must be in 1..64, got {k}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        for name in ("draft_token_cost", "sampled_row_cost"):
            if not 0.0 <= getattr(self, name) < 10.0:
                raise ValueError(f"speculative_config.{name} must be in [0, 10), got {getattr(self, name)}")


def speculative_config_from(value) -> SpeculativeConfig | None:
    """--speculative-config's JSON text, LLM(speculative_config=...)'s dict, or a SpeculativeConfig (None: off);
    a ValueError naming speculative_config for anything else."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    try:
        return SpeculativeConfig.from_dict(value)
    except TypeError as exc:  # a value of the wrong type reaching a comparison
        raise ValueError(f"speculative_config: {exc}") from None


@dataclass(frozen=True)
class EngineConfig(_FromDict):
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self):
        if self.scheduler.async_scheduling and self.parallel.tensor_parallel_size > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size 1: the ranks run each step in lockstep")


LOG_FORMATS = ("text", "json")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic")  # server/tool_calls.py


@dataclass(frozen=True)
class ServerConfig(_FromDict):
    """`pagellm serve`'s own settings (the engine's are EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Each a key clients may send as 'Authorization: Bearer <key>'; empty: no auth. Every route but /health.
    api_keys: tuple[str, ...] = ()
    max_waiting: int = 1024  # most requests waiting to run; beyond it 429
    # The names clients may send as `model`, the first one answered in responses; empty: the model's own
    # (api_server.default_model_names). A single string is one name.
    served_model_name: tuple[str, ...] = ()
    chat_template: str | None = None  # a Jinja template's text, used instead of the model's own
    tool_call_parser: str | None = None  # None: chosen from the chat template
    max_request_bytes: int = 4 << 20  # a request body above this is a 413
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers; "*" allows any origin
    log_format: str = "text"
    pooling: str = "last"  # /v1/embeddings: how hidden states pool (last token, as vLLM pools a causal LM; mean; cls)

    def __post_init__(self):
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        names = self.served_model_name
        object.__setattr__(self, "served_model_name", (names,) if isinstance(names, str) else tuple(names or ()))
        if any(not isinstance(n, str) or not n for n in self.served_model_name):
            raise ValueError("served_model_name must be non-empty strings")
        if self.pooling not in ("mean", "last", "cls"):
            raise ValueError(f"pooling must be one of mean, last, cls, got {self.pooling!r}")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
