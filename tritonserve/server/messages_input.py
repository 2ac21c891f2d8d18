"""What an Anthropic Messages request becomes before it is a chat request: its schema (content
blocks lenient about fields we do not use, such as cache_control), its system and blocks as
chat messages (tool_use as the assistant's tool_calls, tool_result as tool messages; earlier
thinking as the turn's reasoning_content, which the template keeps or drops), its client tools and tool_choice in chat's shape, and `thinking` as the
template's enable_thinking. The route and its stream are server/messages_api.py.
"""
from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from .common import ApiError, validate_as
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
    thinking: str | None = None  # redacted_thinking carries only data


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
        texts, calls, thinking = [], [], []
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
            elif isinstance(block, ThinkingBlock) and block.thinking:
                thinking.append(block.thinking)
        if texts or calls:
            entry = {"role": message.role, "content": "\n".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            if thinking:  # the template decides (gpt-oss keeps it before a call)
                entry["reasoning_content"] = "\n".join(thinking)
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
