"""Resident KV follows the work (core/block_pool.py, runner/host_pages.py) on the embedded model: blocks past the
prefix cache's budget go back to the OS, what was released comes off the resident set, and greedy ids stay those
of an engine that releases nothing, whether a prompt hits the cache, misses it, or lands on released blocks."""

import json
import subprocess
import sys

from pagellm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SYSTEM = "You are a careful assistant who answers questions about rivers and their sources briefly. " * 5
PROMPTS = [SYSTEM + q for q in ("Where does the Nile start?", "Where does the Rhine start?")] + [
    "The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


def _ids(llm, prompts):
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_greedy_ids_unchanged_with_hits_misses_and_released_blocks(embedded_llm):
    # The shared system prompt: 4 of its full blocks survive a budget of 6, the rest (and every short
    # prompt's blocks) are released and written again by later requests.
    tight = LLM(kv_cache_memory=0.25, max_model_len=4096, prefix_cache_memory=6 * embedded_llm.engine.kv_bytes_per_block / 2**30)
    order = PROMPTS + PROMPTS[:2][::-1]  # the first two again: a hit on what the budget kept
    ids = _ids(tight, order)
    stats = tight.stats()
    assert stats["kv_blocks_released"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["kv_blocks_resident"] <= 6 and stats["kv_blocks_used"] == 0
    assert stats["prefix_cache_resident_bytes"] <= stats["prefix_cache_budget_bytes"]
    assert ids == _ids(LLM(kv_cache_memory=0.25, max_model_len=4096, enable_prefix_caching=False), order)


def test_a_zero_budget_keeps_no_idle_block_and_the_pool_is_reused():
    llm = LLM(kv_cache_memory=0.05, max_model_len=1024, prefix_cache_memory=0)
    first = _ids(llm, PROMPTS[:2])
    stats = llm.stats()
    assert stats["kv_resident_bytes"] == 0 and stats["prefix_cache_resident_bytes"] == 0
    assert stats["prefix_cache_hit_tokens"] == 0  # one after the other: nothing idle is kept to hit
    assert _ids(llm, PROMPTS[:2]) == first


_PROBE = r"""
import json, os
from pagellm import LLM, SamplingParams

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

llm = LLM(kv_cache_memory=0.25, max_model_len=4096, prefix_cache_memory=0)
engine = llm.engine
prompt = list(range(1000, 3000))  # 2000 tokens: 125 blocks, ~37 MB of fp16 K/V
rid = engine.add_request(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
while engine.stats()["num_requests_running"] == 0 or engine.scheduler.requests[rid].num_output_tokens < 2:
    engine.step()
live, resident = rss(), engine.stats()["kv_resident_bytes"]
engine.abort(rid)  # the engine is idle: its blocks go back at once
stats = engine.stats()
print(json.dumps({"drop": live - rss(), "released": resident - stats["kv_resident_bytes"],
                  "released_blocks": stats["kv_blocks_released"],
                  "bytes_released": engine.runner.kv_pages.released_bytes_total}))
"""


def test_released_blocks_leave_the_resident_set():
    """In a fresh interpreter (freed memory of earlier tests would blur the figures)."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=True)
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    assert sizes["released_blocks"] >= 125
    assert sizes["bytes_released"] == sizes["released"]  # blocks are whole pages: every byte went back
    assert sizes["drop"] >= 0.9 * sizes["released"] > 30 << 20


def test_an_engine_left_idle_hands_back_its_step_buffers(embedded_llm, monkeypatch):
    released = []
    monkeypatch.setattr("pagellm.runner.backend.release_thread_scratch", lambda: released.append("scratch"))
    monkeypatch.setattr("pagellm.runner.backend.release_freed_heap", lambda: released.append("heap"))
    embedded_llm.generate(PROMPTS[2:4], GREEDY, use_tqdm=False)
    # once, when the last request finished (not after every step); the scratch first, then the heap it freed
    assert released == ["scratch", "heap"]
