"""OpenAI's embeddings endpoint, POST /v1/embeddings: each input's final hidden states pooled into one vector.

The inputs run as prefill-only requests (SamplingParams.pooling, runner/pooling.py) through the same scheduler,
queue and KV budget as generation; their blocks free as soon as their prompt has run. Pooling is the server's
`--pooling` (default "last", as vLLM pools a causal LM; or "mean", "cls"); vectors are scaled to unit length
unless the request says `"normalize": false` (vLLM's extra field). `encoding_format: "base64"` sends each vector
as its little-endian float32 bytes, as OpenAI does.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

from pagellm.llm import normalized
from pagellm.server.converted_requests import check_outer_fields
from pagellm.server.errors import APIError
from pagellm.server.protocol import Int, TokenIds, one_of

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


# vLLM's fields that would change the vectors and are not honoured
_REFUSED = {"truncate_prompt_tokens": one_of(), "add_special_tokens": one_of(True)}


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused by name (_REFUSED) or ignored

    # how a wrong `input` is described (parse_request): pydantic would name only the union's first form
    expected_shapes: ClassVar[dict[str, str]] = {
        "input": "a string, a list of strings, a list of token ids or a list of token-id lists"}

    model: StrictStr | None = None
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int(ge=1) | None = None
    normalize: StrictBool = True
    user: StrictStr | None = None

    def check(self) -> None:
        check_outer_fields(self.model_extra, _REFUSED, frozenset())
        inputs = self.inputs()
        if not inputs or any(len(i) == 0 for i in inputs):
            raise APIError("input must not be empty, nor hold an empty string or token list", "input")
        if len(inputs) > MAX_INPUTS:
            raise APIError(f"input holds {len(inputs)} inputs, more than the {MAX_INPUTS} inputs one request may "
                           "hold", "input")

    def inputs(self) -> list[str | list[int]]:
        """A string, a token-id list, or a list of either, as a list of inputs."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)


def check_dimensions(request: EmbeddingRequest, hidden_size: int) -> None:
    """OpenAI's `dimensions` shortens a vector only for models trained for it; here it must be the model's own."""
    if request.dimensions is not None and request.dimensions != hidden_size:
        raise APIError(f"dimensions: this model's embeddings have {hidden_size} dimensions, and it cannot give "
                       f"{request.dimensions} dimensions; leave dimensions out", "dimensions")


class EmbeddingsFormatter:
    """The list object of OpenAI's embeddings answer, in the order of the inputs."""

    def __init__(self, model_name: str, request: EmbeddingRequest):
        self.request_id = f"embd-{time.monotonic_ns()}"
        self._model, self._request = model_name, request

    def response(self, outputs: list, usage_: dict) -> dict:
        data = [{"object": "embedding", "index": i, "embedding": self._encode(out.embedding)}
                for i, out in enumerate(outputs)]
        return {"object": "list", "data": data, "model": self._model,
                "usage": {"prompt_tokens": usage_["prompt_tokens"], "total_tokens": usage_["prompt_tokens"]}}

    def _encode(self, vector: list[float]) -> list[float] | str:
        vector = normalized(vector) if self._request.normalize else vector
        if self._request.encoding_format == "base64":
            return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        return vector
