"""Pieces every route shares: JSON errors, body parsing, SSE framing, request state."""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields

from aiohttp import web
from pydantic import BaseModel, ValidationError

from tritonserve.engine import Completion, FinishReason, InvalidRequestError, SamplingParams
from tritonserve.engine.limits import COUNTED, RequestLimits
from tritonserve.engine.structured import StructuredOutput

from .stream_hub import EngineDoor
from .streams import StreamFailure, StreamItem
from .chat_template import ChatTemplate
from .errors import ApiError
from .config import ServerConfig
from .metrics import Metrics
from .prompts import check_text
from .schema import SamplingFields, StreamDoneEvent, StreamErrorEvent
from .watchdog import Watchdog

# a \uD800-\uDFFF escape: only then can the parsed body hold a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")




def error_body(code: str, message: str, param: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    """One error shape for every route (OpenAI's): {"error": {message, type, param, code}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def json_error(status: int, code: str, message: str, param: str | None = None,
               headers: dict | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(error_body(code, message, param, kind), status=status,
                             headers=headers)


@dataclass
class ServerState:
    engine: EngineDoor  # the only way into the engine (one or several hosts)
    metrics: Metrics
    config: ServerConfig
    draining: bool = False
    # what the watchdog does after ending the streams (server/watchdog.py); the server's main
    # ends the process
    on_stall: Callable[[str], None] | None = None
    watchdog: Watchdog | None = None
    template: ChatTemplate | None = None  # the chat template and its parsers (build_app sets it)


STATE = web.AppKey("state", ServerState)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _check_strings(value, path: str) -> None:
    """400 naming the field of the first string (or key) that is not valid Unicode."""
    if isinstance(value, str):
        check_text(path or "body", value)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_strings(item, f"{path}.{i}" if path else str(i))
    elif isinstance(value, dict):
        for key, item in value.items():
            field = f"{path}.{key}" if path else key
            check_text(path or "body", key)
            _check_strings(item, field)


async def parse_body(request: web.Request, model: type[BaseModel]) -> BaseModel:
    """The body (at most --max-body-bytes, else 413) as `model`, or a 400 naming the field."""
    raw = await request.read()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "invalid_json", "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", "request body must be a JSON object")
    check_counts(data, request.app[STATE].engine.limits)
    if _SURROGATE_ESCAPE.search(raw):
        try:
            _check_strings(data, "")
        except InvalidRequestError as exc:
            raise ApiError(400, "invalid_request", str(exc), exc.param) from None
    return validate_as(model, data)


def validate_as(model: type[BaseModel], data: dict) -> BaseModel:
    """data as `model`, or a 400 naming the first field that does not fit."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        raise ApiError(400, "invalid_request", problems, param) from None


# SamplingParams fields a body may set by the same name (nano-vllm's fields() filter); logprobs
# and max_tokens differ per route and are passed in; pooling is /v1/embeddings' alone
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams)
                         if f.name not in ("logprobs", "max_tokens", "structured",
                                           "structured_after", "pooling"))


def sampling_params(body: SamplingFields, logprobs: int | None,
                    max_tokens: int | None = None,
                    structured: StructuredOutput | None = None) -> SamplingParams:
    """The body's sampling fields that are set; the rest keep SamplingParams' defaults."""
    options = {name: value for name in _SAMPLING_FIELDS
               if (value := getattr(body, name)) is not None}
    max_tokens = max_tokens if max_tokens is not None else body.max_tokens
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    try:
        return SamplingParams(logprobs=logprobs, structured=structured, **options)
    except InvalidRequestError as exc:
        raise ApiError(400, "invalid_request", str(exc), exc.param) from None


def check_counts(data: dict, limits: RequestLimits) -> None:
    """engine/limits.py's COUNTED fields, on the parsed body before its schema validation."""
    for name in COUNTED:
        value = data.get(name)
        if isinstance(value, (list, dict)):
            problem = limits.over_count(name, len(value))
            if problem is not None:
                raise ApiError(400, "invalid_request", problem, name)


def check_chat_size(messages: list, tools: list | None, limits: RequestLimits) -> None:
    """engine/limits.py's bounds on what the chat template renders, before it runs."""
    check_counts({"messages": messages, "tools": tools}, limits)
    if not tools:
        return
    chars = len(json.dumps(tools))
    if chars > limits.max_tools_chars:
        raise ApiError(400, "invalid_request", f"tools is {chars} characters as JSON; at most "
                       f"{limits.max_tools_chars} (--max-tools-chars)", "tools")


def done_event(done: Completion, request_id: str | None = None) -> StreamDoneEvent:
    t = done.timing
    return StreamDoneEvent(
        request_id=request_id,
        finish_reason=done.reason.value, prompt_tokens=done.prompt_tokens,
        output_tokens=done.output_tokens, text=done.tail_text,
        ttft_ms=t.ttft_s * 1000, total_ms=t.total_s * 1000,
        queue_wait_ms=t.queue_wait_s * 1000, execution_ms=t.execution_s * 1000,
        tokens_per_s=done.output_tokens / t.total_s if t.total_s > 0 else 0.0)


def failure_of(item: StreamItem) -> StreamErrorEvent | None:
    """The error event for an item that ends a stream without a result (engine failure,
    shutdown, abort); None for a normal step."""
    if isinstance(item, StreamFailure):
        return StreamErrorEvent(code=item.code, message=item.message)
    if item.completion is not None and item.completion.reason is FinishReason.ABORT:
        return StreamErrorEvent(code="aborted", message="the request was aborted")
    if item.completion is not None and item.completion.reason is FinishReason.ERROR:
        return StreamErrorEvent(code="engine_error", message=item.completion.error or "")
    return None


def failure_response(failure: StreamErrorEvent, request_id: str) -> web.Response:
    """Non-streaming answers never report a failure under HTTP 200."""
    status = 503 if failure.code in ("shutting_down", "engine_dead") else 500
    return json_error(status, failure.code, failure.message,
                      headers={"X-Request-Id": request_id})


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


async def open_sse(request: web.Request, request_id: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": request_id})
    await response.prepare(request)
    return response


@dataclass(frozen=True)
class NamedEvent:
    """An SSE frame with an `event:` line (the Messages and Responses streams name theirs)."""

    event: str
    data: dict


async def send_sse(response: web.StreamResponse, payload: dict | str | NamedEvent) -> None:
    head = ""
    if isinstance(payload, NamedEvent):
        head, payload = f"event: {payload.event}\n", payload.data
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    await response.write(f"{head}data: {data}\n\n".encode())
