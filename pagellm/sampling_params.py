"""SamplingParams: how one request turns logits into tokens, validated at construction."""

from __future__ import annotations

import json
from dataclasses import dataclass

# Above this a softmax over fp32 logits is numerically meaningless; vLLM caps top-n logprobs similarly.
MAX_LOGPROBS = 20
# Stop strings are matched on the engine thread after every token of the request: bounded so one request cannot
# slow the batch (each string is searched over its own length of tail, output_processor.py). OpenAI allows 4.
MAX_STOP_STRINGS = 128
MAX_STOP_LENGTH = 1024  # characters; a stream holds back this many minus one
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: +-100 bans or forces a token
_GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's _SAMPLING_EPS)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_num_logprobs(name: str, value) -> None:
    if value is not None:
        _check_int(name, value, 0)
        if value > MAX_LOGPROBS:
            raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {value}")


def _check_float(name: str, value, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    items = bias.items() if isinstance(bias, dict) else (bias or ())
    pairs = {}
    for key, value in items:
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r} "
                             f"for token {token}")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match (vLLM's StructuredOutputsParams): exactly one of a JSON schema, any JSON
    object, a regular expression, one of a list of strings, or a grammar (GBNF, as llama.cpp and vLLM take it, or Lark).

    Only the form is checked here; whether the schema, regex or grammar compiles is checked against the
    model's vocabulary when the request is added (runner/grammar.py), as a ValueError naming the field.
    """

    json: str | dict | None = None  # a JSON schema, as an object or its JSON text; kept as canonical text
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.100}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {choice!r:.100}")
            object.__setattr__(self, "choice", tuple(choice))


def _schema_text(schema) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {schema!r:.100}")
    return json.dumps(schema, sort_keys=True)  # one text per schema: compiled grammars are cached by it



POOLING_MODES = (None, "mean", "last", "cls")  # SamplingParams.pooling: none (generate), or how to pool

@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means the whole vocabulary
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs returned per token, besides the sampled one's
    # vLLM's prompt_logprobs: per prompt token after the first, its logprob and the top-k alternatives.
    # Such a request computes its whole prompt itself (no prefix-cache hit) to get every position's logits.
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to the logits before sampling; kept as sorted
    # (id, bias) pairs so the object stays hashable. JSON's string keys ("42") are accepted.
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    min_tokens: int = 0  # vLLM's: no EOS, stop token id or stop string ends the output before this many tokens
    # The output is held to a grammar: each step's logits are masked to the tokens it allows (runner/grammar.py).
    structured_outputs: StructuredOutputs | None = None
    # An embedding request (runner/pooling.py): the prompt's final hidden states pooled ("mean", "last" or "cls"
    # token) into RequestOutput.embedding, nothing generated; a prefill-only request whose blocks free at once.
    pooling: str | None = None

    def __post_init__(self):
        _check_int("max_tokens", self.max_tokens, 1)
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, -1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63))
        _check_float("repetition_penalty", self.repetition_penalty, 1e-6, 100.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_num_logprobs("logprobs", self.logprobs)
        _check_num_logprobs("prompt_logprobs", self.prompt_logprobs)
        # Normalise list-like inputs to tuples so the object stays hashable and immutable.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        longest = max(map(len, stop), default=0)
        if longest > MAX_STOP_LENGTH:
            raise ValueError(f"stop strings must be at most {MAX_STOP_LENGTH} characters, got one of {longest} characters")
        object.__setattr__(self, "stop", tuple(stop))
        ids = tuple(self.stop_token_ids or ())
        for i in ids:
            _check_int("stop_token_ids", i, 0)
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        _check_int("min_tokens", self.min_tokens, 0)
        if self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {', '.join(map(str, POOLING_MODES[1:]))}, got {self.pooling!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise ValueError(f"structured_outputs must be a StructuredOutputs, got {self.structured_outputs!r:.100}")
            if self.min_tokens:  # a grammar may end before min_tokens, when it allows nothing but a stop token
                raise ValueError("min_tokens cannot be combined with structured_outputs")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or one below vLLM's _SAMPLING_EPS: dividing by it takes float32 logits past their range
        (a tie among every positive logit), and the draw it would make is the argmax but for near-ties."""
        return self.temperature < _GREEDY_BELOW

    @property
    def needs_logit_processing(self) -> bool:
        """logit_bias, min_tokens or a grammar: the logits are changed per row before sampling."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.structured_outputs is not None

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
