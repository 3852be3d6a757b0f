"""llama-server's fill-in-the-middle endpoint, POST /infill: what code editors' completion plugins (llama.vim,
llama.vscode) call with the text before and after the cursor.

The prompt is laid out as llama-server lays it out (its format_prompt_infill), so a plugin gets the same
completions from either server:

    [BOS] [FIM_REP] "myproject\n" ([FIM_SEP] filename "\n" text)...  [FIM_SEP] "filename\n"      extra context
    [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

Without FIM_REP / FIM_SEP tokens, each extra chunk is preceded by "\n\n--- snippet ---\n\n". The prefix keeps
its last 3/4 of a 2048-token batch, the suffix its first quarter (less the prompt), the extra context what the
context length leaves. The FIM tokens come from the GGUF's tokenizer.ggml.fim_*_token_id, else from the
vocabulary by their usual texts (Qwen2.5-Coder, StarCoder / Granite, CodeLlama, DeepSeek-Coder); a model without
them gets a 400 naming the missing ones.

The answer is llama-server's completion object (`content`, `tokens_predicted`, `tokens_evaluated`, `stop`,
`stop_type`, `stopping_word`), streamed as `data:` events of the same shape, the last with `stop: true`.
"""

from __future__ import annotations

import json
import uuid
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

from pagellm.server.converted_requests import check_outer_fields
from pagellm.server.errors import APIError
from pagellm.server.protocol import CompletionRequest, Int, absent, one_of, parse_request

# llama.cpp's token texts for each FIM role (llama-vocab.cpp), in its order of preference
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
N_BATCH = 2048  # llama-server's default batch, which bounds the prefix and suffix taken
_SNIPPET = "\n\n--- snippet ---\n\n"
# fields that would change the answer and are not honoured here: name -> whether a value asks for nothing
_REFUSED = {"grammar": one_of(), "json_schema": one_of(), "n": one_of(1), "logprobs": one_of(), "n_probs": absent,
            "stream_options": one_of(), "best_of": one_of(1), "echo": absent, "suffix": one_of()}


class ExtraChunk(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: StrictStr
    filename: StrictStr = "tmp"


class InfillRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # sampling fields pass on to the completion request

    model: StrictStr | None = None
    input_prefix: StrictStr
    input_suffix: StrictStr
    input_extra: list[ExtraChunk] = []
    prompt: StrictStr = ""
    n_predict: Int(ge=-1) | None = None
    stream: StrictBool = False
    # llama-server's fields that tune its own scheduling or reply, with no effect on the tokens here: typed, so a
    # wrong type is a 400 rather than silently ignored
    cache_prompt: StrictBool | None = None
    t_max_prompt_ms: Int() | None = None
    t_max_predict_ms: Int() | None = None
    response_fields: list[StrictStr] | None = None
    samplers: list[StrictStr] | None = None
    id_slot: Int() | None = None

    def check(self) -> None:
        pass


def fim_ids(tokenizer) -> dict[str, int]:
    """The FIM role -> token id of this vocabulary; APIError(400) when prefix, suffix or middle is missing."""
    stated = tokenizer.info.fim_ids or {}
    ids = {role: stated.get(role) if stated.get(role) is not None else
           next((i for text in texts if (i := tokenizer.token_id(text)) is not None), None)
           for role, texts in FIM_TEXTS.items()}
    missing = [role for role in ("pre", "suf", "mid") if ids[role] is None]
    if missing:
        names = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
        raise APIError(f"infill is not supported by this model: its vocabulary has no fill-in-the-middle "
                       f"{', '.join(names[r] for r in missing)} token (as tokenizer.ggml.fim_*_token_id or a known "
                       f"text such as {FIM_TEXTS[missing[0]][0]})", "input_prefix")
    return {role: i for role, i in ids.items() if i is not None}


def infill_tokens(tokenizer, request: InfillRequest, n_ctx: int, n_predict: int) -> list[int]:
    """The prompt's ids, laid out as llama-server's format_prompt_infill (module doc)."""
    ids = fim_ids(tokenizer)

    def encode(text: str) -> list[int]:  # the code around the cursor: special-token text in it is text
        return tokenizer.encode(text, add_special_tokens=False, parse_special=False)

    extra = [ids["rep"], *encode("myproject\n")] if "rep" in ids else []
    for chunk in request.input_extra:
        extra += [ids["sep"], *encode(chunk.filename + "\n")] if "sep" in ids else encode(_SNIPPET)
        extra += encode(chunk.text)
    if "sep" in ids:
        extra += [ids["sep"], *encode("filename\n")]
    prompt = tokenizer.encode(request.prompt, add_special_tokens=False)  # llama-server parses specials here
    prefix, suffix = encode(request.input_prefix), encode(request.input_suffix)
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (N_BATCH // 4)):]
    suffix = suffix[:max(0, min(len(suffix), N_BATCH // 4 - (2 + len(prompt))))]
    n_extra = min(max(0, n_ctx - N_BATCH - 2 * n_predict), len(extra))
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and tokenizer.encode("") else []
    return (extra[len(extra) - n_extra:] + bos + [ids["pre"], *prefix, *prompt] + [ids["suf"], *suffix]
            + [ids["mid"]])


class InfillCompletionRequest(CompletionRequest):
    """The completion request an infill request becomes: its errors about the answer's length name n_predict."""

    @property
    def max_tokens_field(self) -> str:
        return "n_predict"


def completion_request(raw: bytes) -> tuple[InfillRequest, CompletionRequest]:
    """The request and the completion request that samples it (n_predict as max_tokens, repeat_penalty as
    repetition_penalty); APIError(400) naming the field."""
    request = parse_request(raw, InfillRequest)
    fields = dict(request.model_extra or {})
    check_outer_fields({k: v for k, v in fields.items() if k in _REFUSED}, _REFUSED, frozenset())
    if "repeat_penalty" in fields:
        fields["repetition_penalty"] = fields.pop("repeat_penalty")
    if request.n_predict is not None and request.n_predict >= 0:
        fields["max_tokens"] = request.n_predict
    body = {**fields, "prompt": [0], "stream": request.stream, "model": request.model}
    try:
        return request, parse_request(json.dumps(body).encode(), InfillCompletionRequest)
    except APIError as exc:
        exc.param = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty"}.get(exc.param, exc.param)
        raise


class InfillFormatter:
    """llama-server's completion object, whole or as stream events."""

    done_marker = ""  # llama-server's native stream has no [DONE]

    def __init__(self, model_name: str, prompt_tokens: int):
        self.request_id = f"infill-{uuid.uuid4().hex}"
        self._model, self._prompt_tokens = model_name, prompt_tokens

    def response(self, outputs: list, usage_: dict) -> dict:
        return {**self._final(outputs[0]), "content": outputs[0].outputs[0].text}

    def first_chunks(self, num_choices: int, include_usage: bool) -> list[dict]:
        return []

    def chunk(self, index: int, output, include_usage: bool) -> dict | None:
        if output.finished:
            return {**self._final(output), "content": output.new_text or ""}
        if not output.new_text:
            return None
        return {"index": 0, "content": output.new_text, "stop": False}

    def _final(self, output) -> dict:
        completion = output.outputs[0]
        stop = completion.stop_reason if isinstance(completion.stop_reason, str) else ""
        kind = "limit" if completion.finish_reason == "length" else "word" if stop else "eos"
        return {"index": 0, "model": self._model, "stop": True, "stop_type": kind, "stopping_word": stop,
                "tokens_predicted": len(completion.token_ids), "tokens_evaluated": self._prompt_tokens,
                "truncated": False}
