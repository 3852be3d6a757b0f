"""The wire shapes of responses as pydantic models, and /openapi.json with request and response bodies.

responses.py builds answers as plain dicts (a pydantic model per SSE chunk would cost the event loop a
validation per token); these models describe the same fields, and the tests validate real answers against them
(extra fields forbidden), so the schema a client or a fuzzer reads cannot drift from what is sent.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagellm.server.embeddings import EmbeddingRequest
from pagellm.server.infill import InfillRequest
from pagellm.server.messages_api import CountTokensRequest, MessagesRequest
from pagellm.server.responses_api import ResponsesRequest


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Shape):
    cached_tokens: int


class Usage(_Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Shape):
    text_offset: list[int]
    token_logprobs: list[float]
    tokens: list[str]
    top_logprobs: list[dict[str, float]]


class PromptLogprob(_Shape):
    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None] | None  # vLLM's: None, then one dict per prompt token


class CompletionChoice(_Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | int | None
    prompt_logprobs: PromptLogprobs = None


class Completion(_Shape):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # a stream's chunks carry null, its last chunk the totals (include_usage)


class ToolCallFunction(_Shape):
    name: str
    arguments: str  # JSON text


class ToolCall(_Shape):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ToolCallDelta(ToolCall):
    index: int


class TopLogprob(_Shape):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Shape):
    content: list[TokenLogprob]


class AssistantMessage(_Shape):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # models that think (server/reasoning.py)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Shape):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: str | int | None


class ChatCompletion(_Shape):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs = None


class Delta(_Shape):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Shape):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: str | int | None = None


class ChatCompletionChunk(_Shape):
    """One SSE event of a streamed chat answer (the stream ends with `data: [DONE]`)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ErrorDetail(_Shape):
    message: str
    type: str
    param: str | None
    code: Any


class ErrorResponse(_Shape):
    error: ErrorDetail


class AnthropicErrorDetail(_Shape):
    type: str
    message: str
    param: str | None = None  # the request field at fault, as every pagellm 400 names it


class AnthropicErrorResponse(_Shape):
    """Anthropic's error shape, which its clients parse, under /v1/messages."""
    type: Literal["error"]
    error: AnthropicErrorDetail


class HealthStatus(_Shape):
    status: Literal["ok"]


class GenerationSettings(_Shape):
    n_ctx: int


class Props(_Shape):
    """llama-server's /props, the part pagellm answers."""
    chat_template: str
    model_alias: str
    model_path: str
    default_generation_settings: GenerationSettings


class ModelCard(_Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None
    max_model_len: int | None


class ModelList(_Shape):
    object: Literal["list"]
    data: list[ModelCard]


class Tokens(_Shape):
    count: int
    max_model_len: int
    tokens: list[int]


class Detokenized(_Shape):
    prompt: str


class ResponseOutputItem(_Shape):
    model_config = ConfigDict(extra="allow")  # each item type has its own fields
    type: Literal["message", "reasoning", "function_call"]
    id: str
    status: str


class ResponseUsage(_Shape):
    model_config = ConfigDict(extra="allow")
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseObject(_Shape):
    """OpenAI's Response: output items (message with output_text parts, reasoning, function_call), usage."""

    model_config = ConfigDict(extra="allow")  # the request's settings echoed (instructions, tools, ...)

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[ResponseOutputItem]
    usage: ResponseUsage | None = None


class ResponseEvent(_Shape):
    """One event of a Responses stream: response.created ... response.output_text.delta ... response.completed."""

    model_config = ConfigDict(extra="allow")  # each event type has its own fields

    type: str
    sequence_number: int


class AnthropicMessage(_Shape):
    """Anthropic's message: content blocks (thinking, text, tool_use), stop_reason, usage."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[dict[str, Any]]
    stop_reason: str | None
    usage: dict[str, int]


class MessagesEvent(_Shape):
    """One event of a Messages stream: message_start ... content_block_delta ... message_stop."""

    model_config = ConfigDict(extra="allow")
    type: str


class InputTokens(_Shape):
    input_tokens: int


class InfillCompletion(_Shape):
    """llama-server's completion object (streamed: the same shape, `stop` true on the last)."""

    model_config = ConfigDict(extra="allow")
    content: str
    stop: bool


class Embedding(_Shape):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)


class EmbeddingList(_Shape):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: dict[str, int]


# 404: an unknown model (OpenAI's and Anthropic's routes); 413: a body over --max-request-bytes
_ERROR_STATUSES = (400, 401, 404, 413, 429, 503)
_STREAM_ENDS = {"ResponseEvent": ", the last response.completed", "MessagesEvent": ", the last message_stop",
                "InfillCompletion": ", the last with stop true"}
# path -> (request model, response model, the event model of a stream or None)
ROUTES = {
    "/v1/completions": (CompletionRequest, Completion, Completion),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
    "/v1/responses": (ResponsesRequest, ResponseObject, ResponseEvent),
    "/v1/messages": (MessagesRequest, AnthropicMessage, MessagesEvent),
    "/v1/messages/count_tokens": (CountTokensRequest, InputTokens, None),
    "/infill": (InfillRequest, InfillCompletion, InfillCompletion),
    "/v1/embeddings": (EmbeddingRequest, EmbeddingList, None),
    "/tokenize": (TokenizeRequest, Tokens, None),
    "/detokenize": (DetokenizeRequest, Detokenized, None),
}


def route_docs(path: str) -> dict:
    """add_api_route keyword arguments documenting `path`'s body, answer and errors."""
    request, response, event = ROUTES[path]
    error = AnthropicErrorResponse if path.startswith("/v1/messages") else ErrorResponse
    responses: dict = {**{status: {"model": error} for status in _ERROR_STATUSES}, 200: {"model": response}}
    if event is not None:
        ending = _STREAM_ENDS.get(event.__name__, ", then `data: [DONE]`")
        # x-event-schema: what each event's JSON is (OpenAPI 3.1 has no word for a stream's items); a request that
        # fails mid-stream ends with an error event (Anthropic's is a MessagesEvent)
        events = [{"$ref": f"#/components/schemas/{name}"} for name in (event.__name__, error.__name__)
                  if name != "AnthropicErrorResponse"]
        responses[200]["content"] = {"text/event-stream": {"schema": {
            "type": "string", "description": f"stream: true; each `data:` line is a {event.__name__}{ending}"},
            "x-event-schema": {"anyOf": events}}}
    body = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request.__name__}"}}},
            "required": True}
    return {"responses": responses, "openapi_extra": {"requestBody": body}}


def _json(name: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {
        "$ref": f"#/components/schemas/{name}"}}}}


def _get_routes() -> dict[str, dict]:
    """What the GET routes answer (their handlers return plain responses, which FastAPI cannot describe). Each but
    /health needs the API key when the server has one."""
    unauthorized = _json("ErrorResponse", "no or a wrong API key")
    not_ready = _json("ErrorResponse", "the model is loading, or failed to load, or the engine failed")
    return {
        "/health": {"200": _json("HealthStatus", "the model is loaded and the engine running"), "503": not_ready},
        "/metrics": {"200": {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {
            "type": "string"}}}}, "401": unauthorized},
        "/props": {"200": _json("Props", "llama-server's properties"), "401": unauthorized, "503": not_ready},
        "/v1/models": {"200": _json("ModelList", "the served model"), "401": unauthorized},
    }


def install_openapi(app: FastAPI) -> None:
    """/openapi.json: FastAPI's schema plus the request models the routes parse from raw bytes themselves."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            models = [model for request, _, event in ROUTES.values() for model in (request, event) if model]
            for model in models + [HealthStatus, Props, ErrorResponse]:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            for path, responses in _get_routes().items():
                if path in schema["paths"]:
                    schema["paths"][path]["get"]["responses"] = responses
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
