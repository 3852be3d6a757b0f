"""LLM: offline batch generation on LLMEngine, with a progress bar over requests."""

from __future__ import annotations

import math
from typing import Sequence

from tqdm import tqdm

from pagellm.config import (CacheConfig, EngineConfig, KernelConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                            SpeculativeConfig, speculative_config_from)
from pagellm.engine import LLMEngine
from pagellm.outputs import RequestOutput
from pagellm.platform import release_cuda_library_pages
from pagellm.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model=None)` serves the embedded Gemma 3 270M; otherwise a GGUF path or an HF directory."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        kv_cache_memory: float | None = None,
        prefix_cache_memory: float | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        n_ubatch: int = 64,
        decode_stable_interval: int = 0,
        async_scheduling: bool | None = None,
        device: str = "cpu",
        skip_tokenizer_init: bool = False,
        quantization: str = "auto",
        state_cache_memory: float | None = None,
        state_snapshot_memory: float = 1.0,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        distributed_timeout: float = 60.0,
        cpu_isa: str | None = None,
        load_format: str = "auto",
        enforce_eager: bool | None = None,
        cuda_graph_sizes: tuple[int, ...] = (),
        speculative_config: dict | SpeculativeConfig | None = None,
        mamba_ssm_cache_dtype: str = "auto",
        state_snapshot_interval: int | None = None,
    ):
        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, device=device,
                              quantization=quantization, load_format=load_format,
                              enforce_eager=enforce_eager, cuda_graph_sizes=tuple(cuda_graph_sizes)),
            cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                              prefix_cache_memory=prefix_cache_memory, kv_cache_dtype=kv_cache_dtype,
                              gpu_memory_utilization=gpu_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching, state_cache_memory=state_cache_memory,
                              state_snapshot_memory=state_snapshot_memory,
                              mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
                              state_snapshot_interval=state_snapshot_interval),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      n_ubatch=n_ubatch, decode_stable_interval=decode_stable_interval,
                                      async_scheduling=async_scheduling),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                    enable_expert_parallel=enable_expert_parallel,
                                    distributed_timeout=distributed_timeout),
            kernels=KernelConfig() if cpu_isa is None else KernelConfig(cpu_isa=cpu_isa),
            speculative=speculative_config_from(speculative_config),
        )
        self.engine = LLMEngine(config, skip_tokenizer_init=skip_tokenizer_init)
        release_cuda_library_pages(self.engine.device)  # torch links them; a CPU engine runs none of them

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in the order given. Prompts: a string, strings, or token-id lists."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts")
        # Validate every prompt before queueing any, so a bad one leaves no half-submitted batch.
        token_lists = [self.engine.tokenize(p) for p in prompt_list]
        ids = []
        try:
            for prompt, tokens, params in zip(prompt_list, token_lists, params_list):
                ids.append(self.engine.add_request(prompt if isinstance(prompt, str) else tokens, params))
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str = "last", normalize: bool = True,
              use_tqdm: bool = True) -> list[list[float]]:
        """One vector per prompt: its final hidden states pooled ("last" token, as vLLM pools a causal LM; "mean";
        "cls": the first), scaled to unit length unless `normalize` is False. The prompts run as prefill-only
        requests through the same scheduler and KV budget as generation."""
        outputs = self.generate(prompts, SamplingParams(max_tokens=1, pooling=pooling), use_tqdm)
        return [normalized(out.embedding) if normalize else out.embedding for out in outputs]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[rid] for rid in ids]

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel LLM (they also stop when this process exits)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        raise ValueError("a single token-id prompt must be wrapped in a list: generate([[1, 2, 3]])")
    if not prompts:
        raise ValueError("prompts must not be empty")
    return prompts


def normalized(vector: list[float]) -> list[float]:
    """The vector scaled to unit length (a zero vector as it is)."""
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else list(vector)
