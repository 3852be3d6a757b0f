"""The request fields that ask for structured output, read into one StructuredOutputs and the field it came from.

    response_format        OpenAI: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}
    structured_outputs     vLLM's newer form: {"json" | "json_object" | "regex" | "choice" | "grammar": ...}
    guided_json, guided_regex, guided_choice, guided_grammar     vLLM's older form

At most one may ask for a constraint; the field named in errors is the one that did.
"""

from __future__ import annotations

from typing import Any

from pagellm.sampling_params import StructuredOutputs
from pagellm.server.errors import APIError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
BACKENDS = ("guidance", "auto")  # vLLM's guided_decoding_backend values we can honour


def structured_outputs_of(body) -> tuple[StructuredOutputs, str] | None:
    """(what the output must match, the request field that asked) or None; APIError(400) naming the field."""
    found = []
    if body.response_format is not None:
        spec = _from_response_format(body.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if body.structured_outputs is not None:
        found.append((_build("structured_outputs", _structured_values(body.structured_outputs)),
                      "structured_outputs"))
    for field, key in _GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            found.append((_build(field, {key: value}), field))
    if len(found) > 1:
        raise APIError(f"give one way of structuring the output, got {', '.join(f for _, f in found)}", found[1][1])
    if body.guided_decoding_backend not in (None, *BACKENDS):
        raise APIError(f"guided_decoding_backend must be one of {list(BACKENDS)} (pagellm runs llguidance), got "
                       f"{body.guided_decoding_backend!r}", "guided_decoding_backend")
    if body.guided_whitespace_pattern is not None:
        raise APIError("guided_whitespace_pattern is not supported: JSON output is compact", "guided_whitespace_pattern")
    return found[0] if found else None


def _from_response_format(value: dict[str, Any]) -> StructuredOutputs | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
            raise APIError("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return _build("response_format", {"json": inner["schema"]})
    raise APIError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r:.100}",
                   "response_format")


def _structured_values(value: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(value) - set(_STRUCTURED_KEYS))
    if unknown:
        raise APIError(f"structured_outputs has unknown keys {unknown}; it takes one of {list(_STRUCTURED_KEYS)}",
                       "structured_outputs")
    return {k: v for k, v in value.items() if v is not None and v is not False}


def _build(field: str, values: dict[str, Any]) -> StructuredOutputs:
    try:
        return StructuredOutputs(**values)
    except (ValueError, TypeError) as exc:
        message = str(exc).replace("structured_outputs", field, 1) if field != "structured_outputs" else str(exc)
        raise APIError(message, field) from None


def compile_error(exc: ValueError, field: str) -> APIError:
    """The engine's compile error (which speaks of structured_outputs.<key>) in the words of the request field."""
    message = str(exc)
    if message.startswith("ignore_eos"):
        return APIError(message, "ignore_eos")
    if field == "response_format":
        message = message.replace("structured_outputs.json", "response_format.json_schema.schema", 1)
    elif field != "structured_outputs":
        message = message.replace(f"structured_outputs.{_GUIDED[field]}", field, 1)
    return APIError(message, field)
