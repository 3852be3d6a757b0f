"""`pagellm serve`: settings from flags and an optional config file, logging, and uvicorn until a signal.

A config file (`--config FILE`, YAML or JSON) has sections `model`, `cache`, `scheduler`, `parallel`, `kernels`
(EngineConfig) and `server` (ServerConfig, with `chat_template` and `api_key_file` as paths); an unknown section
or key is an error naming it. Flags given on the command line override the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
from pathlib import Path

import uvicorn

from pagellm.config import (CacheConfig, EngineConfig, KernelConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                            ServerConfig, speculative_config_from)
from pagellm.server.api_server import build_app
from pagellm.server.async_engine import AsyncEngine
from pagellm.loader.tokenizer import BUILTIN_CHAT_TEMPLATES

ENGINE_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                   "parallel": ParallelConfig, "kernels": KernelConfig}
_OTHER_SECTIONS = ("server", "speculative")  # the file's sections besides the engine's flags' (speculative: the
# --speculative-config object)
_SERVER_PATHS = ("chat_template", "api_key_file")  # in the file's server section: paths, read here


class _Server(uvicorn.Server):
    """uvicorn, except that SIGINT / SIGTERM first stop the engine and then exit 0.

    Stopping the engine ends every open stream with an error event, so uvicorn's graceful
    shutdown (which waits for open responses) does not wait for generations to finish. uvicorn
    re-raises a captured signal after shutting down, which would end the process with a
    KeyboardInterrupt traceback or status 143; not recording the signal keeps the exit clean.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine):
        super().__init__(config)
        self._engine = engine

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for open connections
        self.should_exit = True
        self._engine.begin_shutdown()


def run_server(args: argparse.Namespace, given: set[str]) -> int:
    """Serve until SIGINT / SIGTERM. `given`: the dests of flags on the command line (they beat the file)."""
    from pagellm.loader.model_loader import resolve_model_path

    engine_config, server_config = configs_from(args, given)
    if engine_config.model.model:
        resolve_model_path(engine_config.model.model)  # a wrong path fails now, not after the server is up
    setup_logging(server_config.log_format)
    app = build_app(engine_config, server_config)
    engine: AsyncEngine = app.state.server.engine
    uv_config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_config=None,
                               timeout_keep_alive=5)
    server = _Server(uv_config, engine)
    engine.on_load_error = lambda: setattr(server, "should_exit", True)
    server.run()
    if engine.load_error is not None:
        print(f"pagellm: error: model load failed: {engine.load_error}", file=sys.stderr)
        return 1
    return 0


def configs_from(args: argparse.Namespace, given: set[str]) -> tuple[EngineConfig, ServerConfig]:
    sections = _read_config_file(args.config) if args.config else {}
    engine_parts = {}
    for name, cls in ENGINE_SECTIONS.items():
        values = dict(sections.get(name, {}))
        for f in dataclasses.fields(cls):
            if f.name in given or f.name not in values:
                values[f.name] = getattr(args, f.name)
        engine_parts[name] = cls.from_dict(values)
    server = dict(sections.get("server", {}))
    flags = {"host": args.host, "port": args.port, "max_waiting": args.max_waiting,
             "served_model_name": args.served_model_name, "tool_call_parser": args.tool_call_parser,
             "max_request_bytes": args.max_request_bytes, "log_format": args.log_format,
             "allowed_origins": tuple(args.allowed_origins or ()), "chat_template": args.chat_template,
             "pooling": args.pooling,
             "api_key_file": args.api_key_file, "api_keys": tuple(args.api_key or ())}
    for name, value in flags.items():
        dest = "api_key" if name == "api_keys" else name  # the flag is --api-key
        if dest in given or name not in server:
            server[name] = value
    name = server["chat_template"]
    server["chat_template"] = BUILTIN_CHAT_TEMPLATES[name] if name in BUILTIN_CHAT_TEMPLATES and not \
        Path(name).exists() else _read("chat_template", name)
    key_file = server.pop("api_key_file", None)
    keys = tuple(server.get("api_keys") or ())
    if key_file:  # one key per line; blank lines and # comments skipped
        lines = _read("api_key_file", key_file).splitlines()
        keys += tuple(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
    server["api_keys"] = keys
    speculative = args.speculative_config
    if "speculative_config" not in given and "speculative" in sections:
        speculative = speculative_config_from(sections["speculative"])
    return EngineConfig(**engine_parts, speculative=speculative), ServerConfig.from_dict(server)


def _read_config_file(path: str) -> dict:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - yaml's and json's errors, reported with the file
        raise ValueError(f"--config {path}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'}: "
                         f"{exc}") from None
    known = sorted([*ENGINE_SECTIONS, *_OTHER_SECTIONS])
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected sections {known}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"--config {path}: unknown section(s) {unknown}; known: {known}")
    for name, section in data.items():
        if not isinstance(section, dict):
            raise ValueError(f"--config {path}: section {name!r} must be a mapping")
    known_server = {f.name for f in dataclasses.fields(ServerConfig)} | set(_SERVER_PATHS)
    unknown = sorted(set(data.get("server", {})) - known_server)
    if unknown:
        raise ValueError(f"--config {path}: server: unknown key(s) {unknown}; known keys are {sorted(known_server)}")
    return data


def _read(what: str, path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--{what.replace('_', '-')} {path}: {exc.strerror}") from None


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (and the traceback when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(log_format: str) -> None:
    """The process's log lines (uvicorn's too: it is started with log_config=None) in one format on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if log_format == "json"
                         else logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
