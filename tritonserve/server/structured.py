"""Request fields that ask for structured output -> engine.StructuredOutput: OpenAI's
`response_format` (json_object, json_schema, text), and vLLM's `structured_outputs`
({json | regex | choice | grammar | json_object}) and older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`. At most one may be set."""
from __future__ import annotations

import json

from tritonserve.engine.structured import StructuredOutput, choice_spec

from .common import ApiError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def _schema_text(value, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ApiError(400, "invalid_request", f"{param} is not valid JSON: {exc}",
                           param) from None
    if not isinstance(value, dict):
        raise ApiError(400, "invalid_request", f"{param} must be a JSON schema object", param)
    return json.dumps(value)


def _from_response_format(fmt: dict) -> StructuredOutput | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", param="response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError(400, "invalid_request", "response_format.json_schema.schema is "
                           "required", "response_format.json_schema")
        return StructuredOutput("json", _schema_text(spec["schema"], "response_format"),
                                "response_format")
    raise ApiError(400, "invalid_request", "response_format.type must be text, json_object "
                   f"or json_schema, got {kind!r}", "response_format.type")


def _from_kind(kind: str, value, param: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput("json", _schema_text(value, param), param)
    if kind == "choice":
        return choice_spec(value, param)
    if kind == "json_object":
        return StructuredOutput("json_object", param=param)
    if not isinstance(value, str) or not value:
        raise ApiError(400, "invalid_request", f"{param} must be a non-empty string", param)
    return StructuredOutput(kind, value, param)


def structured_output(body) -> StructuredOutput | None:
    """The one structured-output request of the body, or None; 400 for two at once."""
    found: list[StructuredOutput] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        spec = _from_response_format(fmt)
        if spec is not None:
            found.append(spec)
    outputs = getattr(body, "structured_outputs", None)
    if outputs:
        for kind, value in outputs.items():
            if value in (None, False):
                continue
            if kind not in ("json", "regex", "choice", "grammar", "json_object"):
                raise ApiError(400, "invalid_request", f"structured_outputs.{kind} is not "
                               "one of json, regex, choice, grammar, json_object",
                               f"structured_outputs.{kind}")
            found.append(_from_kind(kind, value, f"structured_outputs.{kind}"))
    for field, kind in GUIDED.items():
        value = getattr(body, field, None)
        if value is not None:
            found.append(_from_kind(kind, value, field))
    if len(found) > 1:
        raise ApiError(400, "invalid_request", "give at most one of response_format, "
                       "structured_outputs and guided_*: got " +
                       ", ".join(s.param for s in found), found[1].param)
    return found[0] if found else None
