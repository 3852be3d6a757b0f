"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine, run by uvicorn.

    POST /v1/completions, /v1/chat/completions   (stream or not; n completions per prompt)
    POST /v1/responses                           (OpenAI's Responses API, stateless: server/responses_api.py)
    POST /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API: server/messages_api.py)
    GET  /v1/models, /health (503 until the model is loaded), /metrics (Prometheus text), / (chat page),
         /props (llama-server's: the chat template, the context length)
    POST /tokenize, /detokenize, /infill         (llama-server's fill-in-the-middle: server/infill.py)
    POST /v1/embeddings                          (pooled hidden states: server/embeddings.py)

State lives on app.state.server (a ServerState), never in module globals. Every error is an
OpenAI-style body: {"error": {"message", "type", "param", "code"}}; under /v1/messages, Anthropic's
{"type": "error", "error": {"type", "message", "param"}}.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from contextlib import asynccontextmanager

import jinja2
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from pagellm.config import EngineConfig, ServerConfig
from pagellm.sampling_params import SamplingParams
from pagellm.server import embeddings, infill, messages_api
from pagellm.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from pagellm.loader.tokenizer import NO_CHAT_TEMPLATE
from pagellm.server.error_answers import add_error_handlers
from pagellm.server.guards import ApiKeyMiddleware, read_body
from pagellm.server.metrics import ServerMetrics
from pagellm.server.openapi import ModelList, install_openapi, route_docs
from pagellm.server.reasoning import opened_by_prompt, thinks
from pagellm.server.converted_requests import ConvertedChatRequest
from pagellm.server.request_limits import check_capacity, check_token_ids, max_tokens
from pagellm.server.errors import error_body
from pagellm.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest, parse_request)
from pagellm.server.responses import ChatFormatter, CompletionFormatter
from pagellm.server.responses_api import ResponsesFormatter, chat_request
from pagellm.server.streaming import EventStream, collect, sse
from pagellm.server.state import ServerState
from pagellm.server.structured_fields import compile_error
from pagellm.server.tool_calls import parser_for_template

logger = logging.getLogger("pagellm.server")
DEFAULT_MODEL_NAME = "gemma-3-270m"
STATIC_DIR = Path(__file__).parent / "static"  # the chat page: plain HTML, CSS and JS, no build step


def default_model_names(model: str | None) -> tuple[str, ...]:
    """The names a model answers to without --served-model-name: its file or folder name, a GGUF's without the
    extension first (the name /v1/models lists and responses carry), then with it (clients of older pagellm)."""
    if not model:
        return (DEFAULT_MODEL_NAME,)
    path = Path(model)
    return (path.stem, path.name) if path.suffix.lower() == ".gguf" and path.stem else (path.name,)


def build_app(config: EngineConfig, server: ServerConfig | None = None) -> FastAPI:
    server = server or ServerConfig()
    engine = AsyncEngine(config, server.max_waiting)
    metrics = ServerMetrics(engine.stats)
    engine.metrics = metrics
    names = server.served_model_name or default_model_names(config.model.model)
    state = ServerState(engine, metrics, names[0], int(time.time()), server, model_aliases=names[1:])

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()  # loads the model on the engine thread; /health says 503 until it is ready
        yield
        await asyncio.to_thread(engine.shutdown)
        state.text_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pagellm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    add_error_handlers(app)
    if server.api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=server.api_keys)
    if server.allowed_origins:  # added last: outermost, so a CORS preflight is answered before auth
        app.add_middleware(CORSMiddleware, allow_origins=list(server.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    v1 = APIRouter(prefix="/v1")
    v1.add_api_route("/completions", _completions, methods=["POST"], **route_docs("/v1/completions"))
    v1.add_api_route("/chat/completions", _chat_completions, methods=["POST"], **route_docs("/v1/chat/completions"))
    v1.add_api_route("/responses", _responses, methods=["POST"], **route_docs("/v1/responses"))
    v1.add_api_route("/messages", _messages, methods=["POST"], **route_docs("/v1/messages"))
    v1.add_api_route("/messages/count_tokens", _count_tokens, methods=["POST"],
                     **route_docs("/v1/messages/count_tokens"))
    v1.add_api_route("/embeddings", _embeddings, methods=["POST"], **route_docs("/v1/embeddings"))
    v1.add_api_route("/models", _models, methods=["GET"], response_model=ModelList)
    app.include_router(v1)
    app.add_api_route("/", _chat_page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/favicon.ico", _favicon, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    app.add_api_route("/props", _props, methods=["GET"])
    app.add_api_route("/tokenize", _tokenize, methods=["POST"], **route_docs("/tokenize"))
    app.add_api_route("/detokenize", _detokenize, methods=["POST"], **route_docs("/detokenize"))
    app.add_api_route("/infill", _infill, methods=["POST"], **route_docs("/infill"))
    install_openapi(app)
    return app


# ---- shared checks -------------------------------------------------------------------------------

def _ready_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    if state.engine.failure is not None:
        raise APIError(f"engine failed: {state.engine.failure}", status=503)
    if not state.engine.is_ready:
        raise APIError("the model is still loading; retry when /health answers 200", status=503)
    return state


def _check_model(state: ServerState, model: str | None, api: str = "openai") -> None:
    state.check_model(model, api)


# ---- simple endpoints -----------------------------------------------------------------------------

async def _health(request: Request) -> Response:
    """200 {"status": "ok"} when the model is ready; 503 with the cause while it loads or after a failure."""
    engine = request.app.state.server.engine
    if engine.load_error is not None:
        return JSONResponse(error_body(f"model load failed: {engine.load_error}", "service_unavailable_error"),
                            status_code=503)
    if engine.failure is not None:
        return JSONResponse(error_body(f"engine failed: {engine.failure}", "service_unavailable_error"),
                            status_code=503)
    if not engine.is_ready:
        return JSONResponse(error_body("loading", "service_unavailable_error"), status_code=503)
    return JSONResponse({"status": "ok"})  # llama-server's answer: a client may parse it


async def _chat_page(request: Request) -> Response:
    """The chat page (static/index.html): streaming chat with the served model and a live server panel."""
    return FileResponse(STATIC_DIR / "index.html")


async def _favicon(request: Request) -> Response:
    """The page's icon, also where browsers look for one unasked."""
    return FileResponse(STATIC_DIR / "favicon.svg", media_type="image/svg+xml")


async def _props(request: Request) -> dict:
    """llama-server's /props, the part a client reads: the chat template in use ("" when there is none, so the
    chat page offers text completion), the context length, the model."""
    state = _ready_state(request)
    model = state.engine.model
    return {"chat_template": state.chat_template or getattr(model.tokenizer, "chat_template", None) or "",
            "model_alias": state.served_model_name, "model_path": model.path,
            "default_generation_settings": {"n_ctx": model.max_model_len}}


async def _metrics(request: Request) -> Response:
    return Response(request.app.state.server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _models(request: Request) -> dict:
    state: ServerState = request.app.state.server
    model = state.engine.model
    # Each --served-model-name, as vLLM lists them (clients pick a name here); by default the one name
    names = state.config.served_model_name or (state.served_model_name,)
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": state.created, "owned_by": "pagellm",
         "root": model.path if model else None, "max_model_len": model.max_model_len if model else None}
        for name in names]}


async def _tokenize(request: Request) -> dict:
    state = _ready_state(request)
    body = await state.off_loop(parse_request, await read_body(request, state.config.max_request_bytes), TokenizeRequest)
    _check_model(state, body.model, "llama")
    tokenizer = state.tokenizer()

    def tokenize() -> list[int]:
        if body.messages is not None:
            text = _render_chat(tokenizer, body.messages, body.add_generation_prompt, state.chat_template)
        else:
            text = body.prompt
        return tokenizer.encode(text, add_special_tokens=body.add_special_tokens)

    tokens = await state.off_loop(tokenize)
    return {"count": len(tokens), "max_model_len": state.engine.model.max_model_len, "tokens": tokens}


async def _detokenize(request: Request) -> dict:
    state = _ready_state(request)
    body = await state.off_loop(parse_request, await read_body(request, state.config.max_request_bytes), DetokenizeRequest)
    _check_model(state, body.model, "llama")
    check_token_ids(state.engine.model.vocab_size, body.tokens, "tokens")
    return {"prompt": await state.off_loop(state.tokenizer().decode, body.tokens)}


def _render_chat(tokenizer, messages, add_generation_prompt: bool, template: str | None = None,
                 template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
    kwargs = dict(template_kwargs or {}, **({"tools": tools} if tools else {}))
    try:
        return tokenizer.apply_chat_template([m.as_template_dict() for m in messages], add_generation_prompt,
                                             template=template, **kwargs)
    except (jinja2.TemplateError, ValueError) as exc:  # e.g. roles that do not alternate
        raise APIError(f"messages: {exc}", "messages") from None


# ---- generation -----------------------------------------------------------------------------------

async def _completions(request: Request) -> Response:
    arrival = time.monotonic()
    state = _ready_state(request)
    body = await state.off_loop(parse_request, await read_body(request, state.config.max_request_bytes), CompletionRequest)
    _check_model(state, body.model)
    state.note_unknown_fields(body)
    check_capacity(state.config.max_waiting, body, len(body.prompts()))
    prompt_ids = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            prompt_ids.append(await state.encode(prompt, "prompt"))
        else:
            check_token_ids(state.engine.model.vocab_size, prompt, "prompt")
            prompt_ids.append(list(prompt))
    formatter = CompletionFormatter(state.served_model_name, body, state.engine.model.tokenizer)
    return await _generate(request, state, body, prompt_ids, body.max_tokens, body.logprobs, "prompt",
                           formatter, arrival)


async def _chat_completions(request: Request) -> Response:
    arrival = time.monotonic()
    state = _ready_state(request)
    body = await state.off_loop(parse_request, await read_body(request, state.config.max_request_bytes), ChatCompletionRequest)
    return await _chat(request, state, body, arrival)


async def _responses(request: Request) -> Response:
    """OpenAI's Responses API: the same turn as a chat request, in the Responses envelope."""
    arrival = time.monotonic()
    state = _ready_state(request)
    raw = await read_body(request, state.config.max_request_bytes)
    responses_body, body = await state.off_loop(chat_request, raw)
    return await _chat(request, state, body, arrival,
                       lambda chat, _: ResponsesFormatter(state.served_model_name, responses_body, chat))


async def _messages(request: Request) -> Response:
    """Anthropic's Messages API: the same turn as a chat request, as content blocks and Anthropic's events."""
    arrival = time.monotonic()
    state = _ready_state(request)
    body = await state.off_loop(messages_api.chat_request, await read_body(request, state.config.max_request_bytes))
    stops = [body.stop] if isinstance(body.stop, str) else body.stop
    return await _chat(request, state, body, arrival, lambda chat, prompt_tokens: messages_api.MessagesFormatter(
        state.served_model_name, chat, prompt_tokens, stops))


async def _count_tokens(request: Request) -> dict:
    """The prompt tokens a Messages request would have (system, messages and tools rendered by the template)."""
    state = _ready_state(request)
    body = await state.off_loop(messages_api.chat_request, await read_body(request, state.config.max_request_bytes),
                                messages_api.CountTokensRequest)
    _check_model(state, body.model)
    tokenizer = state.tokenizer()
    text = await state.off_loop(_render_chat, tokenizer, body.messages, True, state.chat_template,
                                body.chat_template_kwargs, body.template_tools)
    return {"input_tokens": len(await state.encode(text, "messages"))}


async def _embeddings(request: Request) -> Response:
    """Each input pooled into a vector by a prefill-only request in the same queue and KV budget as generation."""
    arrival = time.monotonic()
    state = _ready_state(request)
    body = await state.off_loop(parse_request, await read_body(request, state.config.max_request_bytes),
                                embeddings.EmbeddingRequest)
    _check_model(state, body.model)
    embeddings.check_dimensions(body, state.engine.model.hidden_size)
    if len(body.inputs()) > state.config.max_waiting:  # a 429 would never clear: the queue never holds them all
        raise APIError(f"input holds {len(body.inputs())} inputs, more than this server ever queues at once "
                       f"({state.config.max_waiting} requests, --max-waiting); split the request", "input")
    prompt_ids = []
    for item in body.inputs():
        ids = await state.encode(item, "input") if isinstance(item, str) else list(item)
        check_token_ids(state.engine.model.vocab_size, ids, "input")
        max_tokens(state.engine.model.max_model_len, len(ids), None, "input")  # the context must hold it
        prompt_ids.append(ids)
    params = [SamplingParams(max_tokens=1, pooling=state.config.pooling)] * len(prompt_ids)
    formatter = embeddings.EmbeddingsFormatter(state.served_model_name, body)
    try:
        stream = await state.engine.add(prompt_ids, params, arrival, formatter.request_id)
    except QueueFullError as exc:
        raise APIError(str(exc), status=429) from None
    except EngineDeadError as exc:
        raise APIError(str(exc), status=503) from None
    return await collect(request, stream, formatter, [len(ids) for ids in prompt_ids], 1)


async def _infill(request: Request) -> Response:
    """llama-server's /infill: the code around the cursor laid out with the model's FIM tokens, then sampled."""
    arrival = time.monotonic()
    state = _ready_state(request)
    infill_body, body = await state.off_loop(infill.completion_request,
                                             await read_body(request, state.config.max_request_bytes))
    _check_model(state, body.model, "llama")
    state.note_unknown_fields(body)
    ids = await state.off_loop(infill.infill_tokens, state.tokenizer(), infill_body,
                               state.engine.model.max_model_len, body.max_tokens or 0)
    return await _generate(request, state, body, [ids], body.max_tokens, None, "input_prefix",
                           infill.InfillFormatter(state.served_model_name, len(ids)), arrival)


async def _chat(request: Request, state: ServerState, body: ChatCompletionRequest, arrival: float,
                envelope=None) -> Response:
    """A chat turn: template, tokens, generation; `envelope` wraps the chat formatter in another API's shape,
    and an error found on the way names that API's fields (the model check's, which echoes the client's name, as
    it is)."""
    _check_model(state, body.model)
    try:
        return await _chat_turn(request, state, body, arrival, envelope)
    except APIError as exc:
        if isinstance(body, ConvertedChatRequest):
            body.in_outer_words(exc)
        raise


async def _chat_turn(request: Request, state: ServerState, body: ChatCompletionRequest, arrival: float,
                     envelope) -> Response:
    state.note_unknown_fields(body)
    check_capacity(state.config.max_waiting, body, 1)
    tokenizer = state.tokenizer()
    template = state.chat_template or tokenizer.chat_template
    if template is None:
        raise APIError(NO_CHAT_TEMPLATE, "messages")
    if body.tool_choice_mode.mode == "auto" and "tools" not in template:
        raise APIError("this model's chat template does not take tools; serve it with --chat-template FILE of one "
                       "that does, or force a call with tool_choice", "tools")
    text = await state.off_loop(_render_chat, tokenizer, body.messages, body.add_generation_prompt,
                                state.chat_template, body.chat_template_kwargs, body.template_tools)
    prompt_ids = [await state.encode(text, "messages")]
    formatter = ChatFormatter(state.served_model_name, body, tokenizer,
                              opened_by_prompt(text) if thinks(tokenizer) else None,
                              state.tool_call_parser or parser_for_template(template))
    if envelope is not None:
        formatter = envelope(formatter, len(prompt_ids[0]))
    return await _generate(request, state, body, prompt_ids, body.requested_max_tokens, body.num_logprobs,
                           "messages", formatter, arrival)


async def _generate(request: Request, state: ServerState, body, prompt_ids: list[list[int]],
                    requested_max_tokens: int | None, num_logprobs: int | None, prompt_param: str,
                    formatter, arrival: float) -> Response:
    token_lists, params = [], []
    for ids in prompt_ids:
        limit = max_tokens(state.engine.model.max_model_len, len(ids), requested_max_tokens, prompt_param,
                           getattr(body, "max_tokens_field", "max_tokens"))
        for child in range(body.n):
            token_lists.append(ids)
            params.append(body.sampling_params(limit, num_logprobs, child))
    if body.structured is not None:  # compiled here, off the loop, so the engine thread finds it cached
        try:
            await state.off_loop(state.engine.check_structured_outputs, params[0])
        except ValueError as exc:
            raise compile_error(exc, body.structured[1]) from None
    try:
        stream = await state.engine.add(token_lists, params, arrival, formatter.request_id)
    except ValueError as exc:  # the engine names the field first (prompt, logit_bias, stop_token_ids)
        field = str(exc).split(" ", 1)[0]
        raise APIError(str(exc), field if field in type(body).model_fields else prompt_param) from None
    except QueueFullError as exc:
        raise APIError(str(exc), status=429) from None
    except EngineDeadError as exc:
        raise APIError(str(exc), status=503) from None
    prompt_lens = [len(ids) for ids in prompt_ids]
    if body.stream:
        return EventStream(sse(stream, formatter, prompt_lens, body.n, body.include_usage), stream)
    return await collect(request, stream, formatter, prompt_lens, body.n)
