"""The KV pool is reserved, not committed: resident memory grows only as blocks are written."""

import os

import torch
from transformers import LlamaConfig

from pagellm.runner.model_runner import ModelRunner, kv_cache_bytes_per_block
from pagellm.models.registry import build_model


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tiny_model():
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=4, num_hidden_layers=2, architectures=["LlamaForCausalLM"])
    model = build_model(config, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(0)
    model.load_weights((name, torch.randn(p.shape, generator=generator) * 0.02)
                       for name, p in model.named_parameters())
    return model


def test_kv_pool_pages_become_resident_only_when_written():
    model = _tiny_model()
    per_block = kv_cache_bytes_per_block(model, 16, torch.float32)
    num_blocks = (1 << 30) // per_block  # a 1 GiB pool
    before = _rss_bytes()
    runner = ModelRunner(model, num_blocks, 16, max_num_seqs=4, dtype=torch.float32, device=torch.device("cpu"))
    reserved = _rss_bytes() - before
    assert reserved < 64 << 20  # far below the 1 GiB reserved
    layer = model.attention_layers()[0]
    layer.key_cache[: num_blocks // 2].fill_(1.0)  # write half of one layer's key blocks
    written = _rss_bytes() - before
    half_of_one_cache = layer.key_cache.numel() * 4 // 2
    assert written >= 0.9 * half_of_one_cache
    del runner
