"""Small builders for core tests: no model involved."""

from pagellm.request import Request
from pagellm.sampling_params import SamplingParams


def make_request(rid: str, tokens, block_size: int = 4, max_tokens: int = 8) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0), block_size)
