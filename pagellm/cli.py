"""`pagellm generate | serve | worker | bench | eval`: engine flags derived from the config dataclasses."""

from __future__ import annotations

import argparse
import logging
import os
import dataclasses
import sys
import types
import typing

from pagellm.collector import collector_paused
from pagellm.config import (CacheConfig, EngineConfig, KernelConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                            SpeculativeConfig, speculative_config_from)
from pagellm.kernels.build.errors import KernelBuildError
from pagellm.server.tool_calls import PARSERS

_ENGINE_SECTIONS = (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                    ("parallel", ParallelConfig), ("kernels", KernelConfig))


def _field_type(cls, f: dataclasses.Field):
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One --flag per config field, typed and documented from the dataclass."""
    for section, cls in _ENGINE_SECTIONS:
        group = parser.add_argument_group(f"{section} options")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = _field_type(cls, f)
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                   help=f.metadata.get("help"))
            elif typing.get_origin(kind) is tuple:  # --cuda-graph-sizes 1 2 4
                group.add_argument(flag, type=typing.get_args(kind)[0], nargs="*", default=default,
                                   help=f.metadata.get("help"))
            else:
                group.add_argument(flag, type=kind, default=default, help=f.metadata.get("help"))
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--speculative-config", type=_speculative_arg, default=None, metavar="JSON",
                       help='vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'. Keys: ' +
                       "; ".join(f"{f.name}: {f.metadata['help']}" for f in dataclasses.fields(SpeculativeConfig)))


def _speculative_arg(text: str):
    try:
        return speculative_config_from(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    parts = {}
    for section, cls in _ENGINE_SECTIONS:
        parts[section] = cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
    return EngineConfig(**parts, speculative=args.speculative_config)


def _generate(args: argparse.Namespace) -> int:
    from pagellm.engine import LLMEngine
    from pagellm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    engine = LLMEngine(engine_config_from_args(args))
    engine.add_request(args.prompt, params)
    sys.stdout.write(args.prompt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    with collector_paused():  # torch's, FastAPI's and the engine's modules: long-lived objects only
        from pagellm.server.start import import_server

        run_server = import_server()

    take_model_argument(args)
    return run_server(args, args.given_flags)


def take_model_argument(args: argparse.Namespace) -> None:
    """`pagellm serve MODEL`, as `vllm serve MODEL`: the positional model is --model, given on the command line
    (so it beats a config file's); both, naming different models, are an error."""
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model_tag
    args.given_flags = args.given_flags | {"model"}


def given_flags_of(argv: list[str]) -> set[str]:
    """The dests of the options that appear in argv (they override a config file): --max-num-seqs and
    --max-num-seqs=8 give max_num_seqs, --no-enable-prefix-caching gives enable_prefix_caching."""
    given = set()
    for token in argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0]
            given.add(name.replace("-", "_"))
            if name.startswith("no-"):
                given.add(name[3:].replace("-", "_"))
    return given


def _add_serve_parser(sub) -> argparse.ArgumentParser:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="A GGUF file or HF checkpoint directory (as --model; default: the embedded model).")
    serve.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    serve.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    serve.add_argument("--config", default=None, metavar="FILE",
                       help="YAML or JSON settings: sections model, cache, scheduler, parallel, kernels, server; "
                            "flags given here override it.")
    serve.add_argument("--api-key", action="append", default=None,
                       help="A key clients must send as 'Authorization: Bearer <key>' on every route but /health "
                            "(else 401); may be given more than once.")
    serve.add_argument("--api-key-file", default=None, metavar="FILE",
                       help="More keys, one per line (blank lines and # comments skipped).")
    serve.add_argument("--max-request-bytes", type=int, default=4 << 20,
                       help="Largest request body accepted (default 4 MiB); above it HTTP 413.")
    serve.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN",
                       help="Enable CORS for this origin (repeat, or '*' for any); off by default.")
    serve.add_argument("--log-format", default="text", choices=["text", "json"],
                       help="Log lines as text or as one JSON object per line.")
    serve.add_argument("--max-waiting", type=int, default=1024,
                       help="Most requests waiting to run; beyond it a request gets HTTP 429.")
    serve.add_argument("--served-model-name", default=None,
                       help="The model name clients send (default: the model file/dir name, or gemma-3-270m).")
    serve.add_argument("--chat-template", default=None, metavar="FILE|NAME",
                       help="A Jinja chat template file used instead of the model's own (as vLLM's flag), or a "
                            "built-in one: gemma, chatml, plain. Without it, a model with no template of its own "
                            "(a base model) answers chat requests with a 400.")
    serve.add_argument("--pooling", default="last", choices=["last", "mean", "cls"],
                       help="How /v1/embeddings pools a prompt's final hidden states (default last: the last "
                            "token's, as vLLM pools a causal LM).")
    serve.add_argument("--tool-call-parser", default=None, choices=list(PARSERS),
                       help="The format tool calls are parsed in (default: chosen from the chat template).")
    add_engine_args(serve)
    serve.set_defaults(func=_serve)
    return serve


def _worker(args: argparse.Namespace) -> int:
    from pagellm.distributed.worker import run_worker

    return run_worker(args.master_addr, args.master_port, args.rank, args.world_size, args.distributed_timeout,
                      args.join_timeout)


def _add_worker_parser(sub) -> None:
    worker = sub.add_parser("worker", help="join a tensor/expert-parallel head as one rank (the head sends the "
                                           "model and engine settings; the model path must exist here too)")
    worker.add_argument("--master-addr", required=True, help="The head's address (its --master-addr).")
    worker.add_argument("--master-port", type=int, required=True, help="The head's --master-port.")
    worker.add_argument("--rank", type=int, required=True, help="This worker's rank, 1 .. world-size - 1.")
    worker.add_argument("--world-size", type=int, required=True, help="The head's --tensor-parallel-size.")
    worker.add_argument("--distributed-timeout", type=float, default=60.0,
                        help="Seconds a collective may wait (use the head's value).")
    worker.add_argument("--join-timeout", type=float, default=600.0,
                        help="Seconds to reach the head and to wait for its settings.")
    worker.set_defaults(func=_worker)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description="LLM inference over a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and stream it to stdout")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    _add_serve_parser(sub)
    _add_worker_parser(sub)
    from pagellm.bench.cli import add_bench_parser; add_bench_parser(sub)
    from pagellm.eval.cli import add_eval_parser; add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with collector_paused():  # the parsers and their modules: long-lived objects
        args = build_parser().parse_args(argv)
    args.given_flags = given_flags_of(argv)
    if not logging.getLogger().handlers:  # start-up lines (e.g. which kernels run) on stderr
        logging.basicConfig(level=logging.INFO, format="pagellm: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ConnectionError, KernelBuildError) as exc:
        print(f"pagellm: error: {exc}", file=sys.stderr)
        return 2


def run() -> None:
    """Console entry point: run a command, then leave without interpreter teardown.

    Some paths still import torch._dynamo, which loads triton: transformers' modeling code (`pagellm bench`'s
    HF peer) and its tokenizer conversion of an HF directory on a start-up cache miss
    (loader/tokenizer_conversion.py); at teardown triton's nanobind bindings print hundreds of "leaked function"
    lines to stderr. The command's work is complete and flushed by then, so skipping teardown loses nothing.
    """
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
