"""`pagellm generate | serve | worker | bench | eval`: engine flags derived from the config dataclasses."""

from __future__ import annotations

import argparse
import logging
import os
import dataclasses
import sys
import types
import typing
from pathlib import Path

from pagellm.collector import collector_paused
from pagellm.config import (CacheConfig, EngineConfig, KernelConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                            SpeculativeConfig, speculative_config_from)
from pagellm.kernels.build.errors import KernelBuildError
from pagellm.server.tool_calls import PARSERS

_ENGINE_SECTIONS = (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                    ("parallel", ParallelConfig), ("kernels", KernelConfig))

# The help's groups, in the order a person reads them: what is served and how it runs, then the tuning.
GENERATION, SERVER, MODEL, ENGINE, CACHE, CPU, GPU, DISTRIBUTED = (
    "generation", "server", "model", "engine", "cache and scheduler", "CPU", "GPU", "distributed")
HELP_GROUPS = (GENERATION, SERVER, MODEL, ENGINE, CACHE, CPU, GPU, DISTRIBUTED)
_SECTION_GROUPS = {"model": MODEL, "cache": CACHE, "scheduler": CACHE, "parallel": DISTRIBUTED, "kernels": CPU}
# Fields whose flag a reader looks for elsewhere than their config section: how the engine runs, or GPU only.
_FIELD_GROUPS = {"device": ENGINE, "dtype": ENGINE, "quantization": ENGINE, "async_scheduling": ENGINE,
                 "gpu_memory_utilization": GPU, "enforce_eager": GPU, "cuda_graph_sizes": GPU}
# What a default of None (or nothing) means, where the help text does not say it already.
_UNSET_MEANS = {"model": "the embedded Gemma 3 270M", "enforce_eager": "unset: CUDA graphs where they apply",
                "async_scheduling": "unset: on where the decode steps replay CUDA graphs",
                "speculative_config": "off", "config": "none", "api_key": "none, no key is asked for",
                "api_key_file": "none", "chat_template": "the model's own", "seed": "none, unseeded"}
_METAVARS = {"quantization": "SCHEME", "cpu_isa": "LEVEL", "kv_cache_dtype": "DTYPE", "load_format": "FORMAT",
             "mamba_ssm_cache_dtype": "DTYPE", "cache_dir": "DIR", "master_addr": "ADDR", "master_port": "PORT",
             "cuda_graph_sizes": "N"}

# The flags `--help` lists (`--help-all` lists every one), by dest, with a shorter text where the full one is
# long; None keeps the full text.
_COMMON_FLAGS = {
    "prompt": None, "max_tokens": None, "temperature": None, "seed": None,
    "model_tag": None, "model": "A GGUF file or HF checkpoint directory (default: the embedded Gemma 3 270M).",
    "host": None, "port": None, "config": None,
    "api_key": "A key clients must send as 'Authorization: Bearer <key>'; may be repeated.",
    "served_model_name": "The names clients may send as `model`; the first is the one responses carry (default: "
                         "the model file's name without .gguf, or the folder name).",
    "chat_template": "A Jinja chat template file, or a built-in one: gemma, chatml, plain.",
    "max_model_len": None, "device": None,
    "dtype": "Compute dtype: auto, float32, bfloat16 or float16 (auto, the default, follows the device and file).",
    "quantization": "Weights kept quantized in memory: auto (the default: a GGUF as stored), none, int8 or int4.",
    "max_num_seqs": None,
    "kv_cache_memory": "KV cache budget in GiB (default: from the host's RAM, or a GPU's free memory).",
    "tensor_parallel_size": None,
}


def _field_type(cls, f: dataclasses.Field):
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint


def help_groups(parser: argparse.ArgumentParser, *names: str) -> dict[str, argparse._ArgumentGroup]:
    """The parser's help groups, created in reading order: `names` (its own) before the engine's."""
    wanted = set(names) | {MODEL, ENGINE, CACHE, CPU, GPU, DISTRIBUTED}
    return {name: parser.add_argument_group(name) for name in HELP_GROUPS if name in wanted}


def _metavar(name: str, kind) -> str | None:
    if name in _METAVARS:
        return _METAVARS[name]
    if kind is int:
        return "N"
    if kind is float:
        return "GIB" if name.endswith("_memory") else "SECONDS" if name.endswith("_timeout") else "X"
    return None


def add_engine_args(parser: argparse.ArgumentParser, groups: dict | None = None) -> None:
    """One --flag per config field, typed and documented from the dataclass, in its help group."""
    groups = groups or help_groups(parser)
    for section, cls in _ENGINE_SECTIONS:
        for f in dataclasses.fields(cls):
            group = groups[_FIELD_GROUPS.get(f.name, _SECTION_GROUPS[section])]
            flag = "--" + f.name.replace("_", "-")
            kind = _field_type(cls, f)
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                   help=f.metadata.get("help"))
            elif typing.get_origin(kind) is tuple:  # --cuda-graph-sizes 1 2 4
                group.add_argument(flag, type=typing.get_args(kind)[0], nargs="*", default=default,
                                   metavar=_metavar(f.name, kind), help=f.metadata.get("help"))
            else:
                group.add_argument(flag, type=kind, default=default, metavar=_metavar(f.name, kind),
                                   help=f.metadata.get("help"))
    groups[ENGINE].add_argument(
        "--speculative-config", type=_speculative_arg, default=None, metavar="JSON",
        help='Speculative decoding, as vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'. '
             "Keys: " + "; ".join(f"{f.name}: {f.metadata['help'].rstrip('.')}"
                                  for f in dataclasses.fields(SpeculativeConfig)) + ".")


def _with_default(text: str | None, action: argparse.Action) -> str | None:
    """The help text, ending with the action's default unless the text already says it."""
    if text is None or action.required or action.default is argparse.SUPPRESS or "default" in text.lower():
        return text
    value = action.default
    if value is None or value == ():
        words = _UNSET_MEANS.get(action.dest, "none")
    elif isinstance(value, bool):
        words = "on" if value else "off"
    else:
        words = str(value).replace("%", "%%")  # argparse formats help texts with %
    if text.endswith("."):  # the default inside the sentence
        return f"{text[:-1]} (default: {words})."
    return f"{text} (default: {words})"


class _HelpAllAction(argparse.Action):
    """--help-all: every flag with its full text, in its group, then exit."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:
            action.help = getattr(action, "full_help", action.help)
        parser.epilog = None
        parser.print_help()
        parser.exit()


def short_help(parser: argparse.ArgumentParser, usage: str) -> None:
    """`--help` lists the common flags (with a shorter text where the full one runs long), `--help-all` every
    flag; both show each flag's default."""
    parser.add_argument("--help-all", action=_HelpAllAction, help="show every option, grouped, and exit")
    next(a for a in parser._actions if isinstance(a, argparse._HelpAction)).help = "show the common options and exit"
    shown = hidden = 0
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, _HelpAllAction)):
            continue
        action.full_help = _with_default(action.help, action)
        brief = _COMMON_FLAGS.get(action.dest, argparse.SUPPRESS)
        if brief is argparse.SUPPRESS:
            action.help, hidden = argparse.SUPPRESS, hidden + 1
        else:
            action.help, shown = action.full_help if brief is None else _with_default(brief, action), shown + 1
    parser.usage = usage
    groups = ", ".join(g.title for g in parser._action_groups[2:] if g._group_actions)  # after argparse's own two
    parser.epilog = (f"The common options only: {parser.prog} --help-all shows all {shown + hidden}, "
                     f"grouped: {groups}.")


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
    names = getattr(args, "served_model_name", None) or []
    if args.model_tag is None and args.model is None and len(names) > 1 and _names_a_model(names[-1]):
        # --served-model-name takes several names, so a model after it is read as one more (as in vLLM)
        raise ValueError(f"--served-model-name took {names[-1]!r} as a name: give MODEL before "
                         "--served-model-name, or as --model")
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model_tag
    args.given_flags = args.given_flags | {"model"}


def _names_a_model(name: str) -> bool:
    return name.lower().endswith(".gguf") or Path(name).exists()


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
    about = "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)"
    serve = sub.add_parser("serve", help=about, description=about + ".")
    groups = help_groups(serve, SERVER)
    server, model = groups[SERVER], groups[MODEL]
    model.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="A GGUF file or HF checkpoint directory (as --model; default: the embedded model).")
    server.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    server.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    server.add_argument("--config", default=None, metavar="FILE",
                        help="YAML or JSON settings: sections model, cache, scheduler, parallel, kernels, server; "
                             "flags given here override it.")
    server.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="A key clients must send as 'Authorization: Bearer <key>' on every route but /health "
                             "(else 401); may be given more than once.")
    server.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="More keys, one per line (blank lines and # comments skipped).")
    server.add_argument("--max-request-bytes", type=int, default=4 << 20, metavar="N",
                        help="Largest request body accepted (default 4 MiB); above it HTTP 413.")
    server.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN",
                        help="Enable CORS for this origin (repeat, or '*' for any); off by default.")
    server.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="Log lines as text or as one JSON object per line.")
    server.add_argument("--max-waiting", type=int, default=1024, metavar="N",
                        help="Most requests waiting to run; beyond it a request gets HTTP 429.")
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="The names clients may send as `model` (aliases, as vLLM takes them); the first is the "
                            "name responses carry (default: the model file's name without .gguf, or the folder "
                            "name; gemma-3-270m for the embedded model).")
    model.add_argument("--chat-template", default=None, metavar="FILE|NAME",
                       help="A Jinja chat template file used instead of the model's own (as vLLM's flag), or a "
                            "built-in one: gemma, chatml, plain. Without it, a model with no template of its own "
                            "(a base model) answers chat requests with a 400.")
    model.add_argument("--tool-call-parser", default=None, choices=list(PARSERS),
                       help="The format tool calls are parsed in (default: chosen from the chat template).")
    model.add_argument("--pooling", default="last", choices=["last", "mean", "cls"],
                       help="How /v1/embeddings pools a prompt's final hidden states (default last: the last "
                            "token's, as vLLM pools a causal LM).")
    add_engine_args(serve, groups)
    short_help(serve, "%(prog)s [MODEL] [options]")
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
    for action in worker._actions:
        action.help = _with_default(action.help, action)
    worker.set_defaults(func=_worker)


def _add_generate_parser(sub) -> None:
    about = "complete one prompt and stream it to stdout"
    gen = sub.add_parser("generate", help=about, description=about[0].upper() + about[1:] + ".")
    groups = help_groups(gen, GENERATION)
    sampling = groups[GENERATION]
    sampling.add_argument("--prompt", required=True, metavar="TEXT", help="The text to complete.")
    sampling.add_argument("--max-tokens", type=int, default=32, metavar="N", help="Tokens to generate.")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="X", help="Sampling temperature; 0 is "
                          "greedy.")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="X", help="Nucleus sampling's mass.")
    sampling.add_argument("--top-k", type=int, default=-1, metavar="N", help="Most likely tokens sampled from; -1: "
                          "all.")
    sampling.add_argument("--seed", type=int, default=None, metavar="N", help="Seed of the sampler.")
    add_engine_args(gen, groups)
    short_help(gen, "%(prog)s --prompt TEXT [options]")
    gen.set_defaults(func=_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description="LLM inference over a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
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
