"""ServerState: what the HTTP routes share (the engine, metrics, settings), and the text work kept off the
event loop (body parsing, chat templating, tokenization) on a small pool of lower-priority threads."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pagellm.config import ServerConfig
from pagellm.server.async_engine import AsyncEngine
from pagellm.server.metrics import ServerMetrics
from pagellm.server.errors import MAX_ECHOED_CHARS, clip
from pagellm.server.protocol import APIError

logger = logging.getLogger("pagellm.server")
UNKNOWN_FIELDS_LOGGED = 8  # per request
UNKNOWN_FIELDS_REMEMBERED = 256  # per server: past it, unknown fields are no longer logged


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: ServerMetrics
    served_model_name: str
    created: int
    config: ServerConfig = field(default_factory=ServerConfig)

    @property
    def chat_template(self) -> str | None:  # --chat-template: used instead of the model's own
        return self.config.chat_template

    @property
    def tool_call_parser(self) -> str | None:  # --tool-call-parser; None: chosen from the chat template
        return self.config.tool_call_parser
    # Tokenization, chat templating and body parsing run here, never on the event loop: a multi-megabyte
    # prompt takes seconds to tokenize, and every other request (/health too) would wait on the loop. The
    # Rust tokenizer releases the GIL while it works, so the loop keeps serving meanwhile.
    text_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        max_workers=2, thread_name_prefix="pagellm-text", initializer=_yield_to_the_engine))

    model_aliases: tuple[str, ...] = ()  # more names clients may send (--served-model-name's after the first)
    # Names of ignored request fields already logged: bounded, as is each logged name, since they come from
    # clients (a fuzzer's one request can carry thousands of distinct keys, each megabytes long).
    unknown_fields_seen: set[str] = field(default_factory=set)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name,) + tuple(self.model_aliases)

    def check_model(self, model: str | None, api: str = "openai") -> None:
        """A request's `model` must be a name this server answers to: a 404 as OpenAI's and Anthropic's APIs
        (and vLLM) answer an unknown model, a 400 on llama-server's routes; the name is echoed cut short."""
        if model is None or model in self.model_names:
            return
        served = ", ".join(repr(name) for name in self.model_names)
        raise APIError(f"the model {clip(model)} does not exist; this server serves {served}", "model",
                       status=404 if api == "openai" else 400)

    def note_unknown_fields(self, body) -> None:
        """Log each request field no model field knows, once per name per server: it was ignored. At most
        UNKNOWN_FIELDS_LOGGED names per request and UNKNOWN_FIELDS_REMEMBERED per server are logged."""
        names = [name for name in body.unknown_fields() if name[:MAX_ECHOED_CHARS] not in self.unknown_fields_seen]
        for name in names[:UNKNOWN_FIELDS_LOGGED]:
            if len(self.unknown_fields_seen) >= UNKNOWN_FIELDS_REMEMBERED:
                return
            self.unknown_fields_seen.add(name[:MAX_ECHOED_CHARS])
            logger.warning("ignoring request field %s, which pagellm does not know (logged once)", clip(name))
        if len(names) > UNKNOWN_FIELDS_LOGGED:
            logger.warning("ignoring %d more unknown request fields in that request (not logged)",
                           len(names) - UNKNOWN_FIELDS_LOGGED)

    def tokenizer(self):
        tokenizer = self.engine.model.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer: send token ids", "prompt")
        return tokenizer

    async def off_loop(self, fn, *args):
        """fn(*args) on the text pool, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, functools.partial(fn, *args))

    async def encode(self, text: str, param: str) -> list[int]:
        """The prompt's ids, tokenized off the loop; a text too long to fit the context in any tokenization is
        refused before tokenizing (a 400 naming `param`): its seconds of work could only end in that 400."""
        limit = self.engine.model.max_model_len
        tokenizer = self.tokenizer()
        if len(text) > self.engine.model.max_prompt_chars:
            raise APIError(f"this model's maximum context length is {limit} tokens, and the "
                           f"{param} has {len(text)} characters: more than that many tokens can hold; shorten it",
                           param)
        return await self.off_loop(tokenizer.encode, text)


def _yield_to_the_engine() -> None:
    """Text threads run at a lower priority than the engine: on a machine with as many cores as the engine has
    threads, a long tokenization otherwise takes a core from every decode step (Linux: per-thread niceness)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
