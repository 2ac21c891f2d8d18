"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, for Claude Code
and Anthropic-SDK agents.

A request is translated into a chat request (system, text blocks, tool_use as the assistant's
tool_calls, tool_result as tool messages, tools as functions, tool_choice auto / any / tool /
none, stop_sequences, thinking as the template's enable_thinking) and goes through the same
preparation as chat (server/chat_prepare.py: template, tool grammar, limits). The output is
ChatOutput's (reasoning split off, tool calls parsed) as content blocks: `thinking`, `text`,
`tool_use` (server/blocks.py). Streams send message_start, content_block_start / delta / stop
per block, message_delta (stop_reason, usage) and message_stop, each with its `event:` name; a
failure mid-stream is an `error` event. Errors have Anthropic's shape (app.error_dialect).

Not served: images and documents (a 400 naming the block), server tools (web search, bash,
text editor: a 400 naming the tool). thinking.budget_tokens is accepted but not enforced.
"""
from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from tritonserve.engine import FinishReason

from .blocks import REASONING, TEXT, Block, BlockEvent, BlockStream, blocks_of
from .chat_output import ChatOutput
from .chat_prepare import PreparedChat, prepare_chat
from .common import ApiError, NamedEvent, validate_as
from .driver import Choice, Payload, Renderer, respond
from .routes_openai import opened, started
from .schema import ChatCompletionRequest, Strict


class Lenient(BaseModel):
    """A content block: fields we do not use (cache_control, citations) are ignored."""

    model_config = ConfigDict(extra="ignore")


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class MediaBlock(Lenient):
    type: Literal["image", "document"]


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[Union[TextBlock, MediaBlock], Field(discriminator="type")]] \
        | None = None
    is_error: bool = False


class ThinkingBlock(Lenient):
    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[Union[TextBlock, MediaBlock, ToolUseBlock, ToolResultBlock,
                               ThinkingBlock], Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(Lenient):
    name: str
    description: str | None = None
    input_schema: dict | None = None
    type: str | None = None  # "custom", or a server tool's versioned type


class MessagesRequest(Strict):
    model: str | None = None
    max_tokens: int | None = None  # required by /v1/messages, not by count_tokens
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    metadata: dict | None = None
    service_tier: str | None = None


def _text(content, field: str) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    for j, block in enumerate(content):
        if isinstance(block, MediaBlock):
            raise ApiError(400, "invalid_request", f"{block.type} blocks are not supported: "
                           "this server serves text models", f"{field}.{j}")
    return "\n".join(block.text for block in content)


def _chat_messages(body: MessagesRequest) -> list[dict]:
    out: list[dict] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system, "system")})
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts, calls = [], []
        for j, block in enumerate(message.content):
            where = f"messages.{i}.content.{j}"
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": _text(block.content, f"{where}.content")})
            elif isinstance(block, MediaBlock):
                _text([block], f"messages.{i}.content")
            # thinking blocks of earlier turns are dropped, as chat templates drop them
        if texts or calls:
            entry = {"role": message.role, "content": "\n".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def _tools(body: MessagesRequest) -> tuple[list[dict] | None, object, bool | None]:
    """-> chat's (tools, tool_choice, parallel_tool_calls)."""
    tools = None
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.input_schema is None or tool.type not in (None, "custom"):
                raise ApiError(400, "unsupported_parameter", f"server tool {tool.type or ''}"
                               f"{' ' if tool.type else ''}{tool.name!r} is not supported: "
                               "only client tools with an input_schema", f"tools.{i}")
            tools.append({"type": "function", "function": {
                "name": tool.name, "description": tool.description or "",
                "parameters": tool.input_schema}})
    choice, parallel = body.tool_choice, None
    if choice is None:
        return tools, None, None
    kind = choice.get("type")
    if choice.get("disable_parallel_tool_use"):
        parallel = False
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ApiError(400, "invalid_request", "a tool choice of type tool names it",
                           "tool_choice.name")
        mapped = {"type": "function", "function": {"name": choice["name"]}}
    if mapped is None:
        raise ApiError(400, "invalid_request", "tool_choice.type must be auto, any, tool or "
                       f"none, got {kind!r}", "tool_choice.type")
    return tools, mapped, parallel


def _thinking(body: MessagesRequest) -> dict | None:
    if body.thinking is None:
        return None
    kind = body.thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ApiError(400, "invalid_request", "thinking.type must be enabled, adaptive or "
                       f"disabled, got {kind!r}", "thinking.type")
    return {"enable_thinking": kind != "disabled"}


def as_chat(body: MessagesRequest) -> ChatCompletionRequest:
    tools, tool_choice, parallel = _tools(body)
    return validate_as(ChatCompletionRequest, {
        "model": body.model, "messages": _chat_messages(body),
        "max_completion_tokens": body.max_tokens, "stop": body.stop_sequences,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel,
        "chat_template_kwargs": _thinking(body)})


# ---- the answer --------------------------------------------------------------------------
def _start_block(block: Block) -> dict:
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": "", "signature": ""}
    if block.kind == TEXT:
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}


def _whole_block(block: Block) -> dict:
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == TEXT:
        return {"type": "text", "text": block.text}
    try:
        arguments = json.loads(block.text or "{}")
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def _delta(event: BlockEvent) -> dict:
    kind = event.block.kind
    if kind == REASONING:
        return {"type": "thinking_delta", "thinking": event.delta}
    if kind == TEXT:
        return {"type": "text_delta", "text": event.delta}
    return {"type": "input_json_delta", "partial_json": event.delta}


class MessagesRenderer(Renderer):
    def __init__(self, state, request_id: str, body: MessagesRequest, chat: PreparedChat):
        self.id = request_id
        self.model = body.model or state.engine.card.name
        self.stops = tuple(body.stop_sequences or ())
        self.prompt_tokens = len(chat.prompt_ids)
        self._output = lambda: ChatOutput(chat.template.reasoning_parser, chat.prompt_text,
                                          chat.plan)
        self.stream_output = self._output()
        self.blocks = BlockStream()

    def _stop(self, completion, has_calls: bool) -> tuple[str, str | None]:
        matched = completion.matched_stop
        if completion.reason is FinishReason.LENGTH:
            return "max_tokens", None
        if has_calls:
            return "tool_use", None
        if isinstance(matched, str) and matched in self.stops:
            return "stop_sequence", matched
        return "end_turn", None

    def _usage(self, output_tokens: int, cached: int = 0) -> dict:
        return {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def _message(self, content: list, stop=(None, None), output_tokens: int = 0,
                 cached: int = 0) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": self._usage(output_tokens, cached)}

    def _events(self, events: list[BlockEvent]) -> list[Payload]:
        out: list[Payload] = []
        for e in events:
            if e.what == "start":
                out.append(NamedEvent("content_block_start", {
                    "type": "content_block_start", "index": e.block.index,
                    "content_block": _start_block(e.block)}))
            elif e.what == "delta":
                out.append(NamedEvent("content_block_delta", {
                    "type": "content_block_delta", "index": e.block.index,
                    "delta": _delta(e)}))
            else:
                out.append(NamedEvent("content_block_stop", {
                    "type": "content_block_stop", "index": e.block.index}))
        return out

    def start(self) -> list[Payload]:
        return [NamedEvent("message_start", {"type": "message_start",
                                             "message": self._message([])})]

    def token(self, index, token) -> list[Payload]:
        return self._events(self.blocks.feed(self.stream_output.delta(token.text)))

    def finish(self, index, completion) -> list[Payload]:
        delta = self.stream_output.final_delta(completion.tail_text)
        out = self._events(self.blocks.feed(delta) + self.blocks.finish())
        stop_reason, stop_sequence = self._stop(completion, self.blocks.has_calls)
        out.append(NamedEvent("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": self._usage(completion.output_tokens, completion.cached_tokens)}))
        out.append(NamedEvent("message_stop", {"type": "message_stop"}))
        return out

    def failure(self, failure) -> list[Payload]:
        return [NamedEvent("error", {"type": "error", "error": {
            "type": "api_error", "message": f"{failure.code}: {failure.message}"}})]

    def response(self, choices: list[Choice]) -> dict:
        choice = choices[0]
        output = self._output()
        blocks = blocks_of(output.message(choice.text))
        done = choice.completion
        return self._message([_whole_block(b) for b in blocks],
                             self._stop(done, output.has_calls), done.output_tokens,
                             done.cached_tokens)


async def messages(request: web.Request) -> web.StreamResponse:
    state, arrival, body = await opened(request, MessagesRequest, ())
    if body.max_tokens is None:
        raise ApiError(400, "invalid_request", "max_tokens is required", "max_tokens")
    chat = await prepare_chat(state, as_chat(body))
    request_id = started(request, "msg")
    items = await state.engine.submit(request_id, [chat.prompt_ids], chat.params, arrival)
    renderer = MessagesRenderer(state, request_id, body, chat)
    return await respond(request, request_id, items, renderer, body.stream)


async def count_tokens(request: web.Request) -> web.Response:
    state, _, body = await opened(request, MessagesRequest, ())
    chat = await prepare_chat(state, as_chat(body))
    return web.json_response({"input_tokens": len(chat.prompt_ids)})


def is_messages_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


@web.middleware
async def error_dialect(request: web.Request, handler):
    """Errors of the Messages routes in Anthropic's shape: {"type": "error", "error": {type,
    message}} (the other routes keep OpenAI's)."""
    response = await handler(request)
    if response.status < 400 or not is_messages_path(request.path) \
            or not isinstance(response, web.Response) or response.body is None:
        return response
    try:
        error = json.loads(response.body)["error"]
    except (ValueError, KeyError, TypeError):
        return response
    kind = _ERROR_TYPES.get(response.status, "api_error")
    message = error.get("message", "") if isinstance(error, dict) else str(error)
    if isinstance(error, dict) and error.get("param"):
        message = f"{error['param']}: {message}"
    headers = {k: v for k, v in response.headers.items()
               if k.lower() not in ("content-type", "content-length")}
    return web.json_response({"type": "error", "error": {"type": kind, "message": message}},
                             status=response.status, headers=headers)
