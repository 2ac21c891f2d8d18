"""What a Responses API request becomes before it is a chat request: its schema, its input
items as chat messages (text, function_call, function_call_output; a reasoning item as the
next assistant turn's reasoning_content; instructions as the system message), its function tools and tool_choice in chat's shape, text.format as chat's
response_format, and the conversation of `previous_response_id` from a bounded in-memory
store (ResponseStore; `store: false` keeps a response out of it). The route and its stream
are server/responses_api.py.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web
from pydantic import Field

from .common import ApiError, validate_as
from .schema import ChatCompletionRequest, Strict

# the built-in tools OpenAI runs on its side; a request naming one gets a 400 naming it
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview",
                  "code_interpreter", "image_generation", "mcp", "local_shell", "shell",
                  "apply_patch", "custom")


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    reasoning: dict | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    # sampling beyond OpenAI's (sglang-router sends them at their defaults)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool | None = False
    stream_options: dict | None = None
    metadata: dict | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # not served: a request that sets one gets a 400 naming it (responses_api.UNSUPPORTED)
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    max_tool_calls: int | None = None


@dataclass(frozen=True)
class Stored:
    response: dict  # as GET /v1/responses/{id} returns it
    messages: tuple[dict, ...]  # the conversation through this response, as chat messages


class ResponseStore:
    """The last `capacity` stored responses, least recently used dropped first."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, stored: Stored) -> None:
        self._items[stored.response["id"]] = stored
        self._items.move_to_end(stored.response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        stored = self._items.get(response_id)
        if stored is None:
            raise ApiError(404, "not_found", f"no stored response {response_id!r} (responses "
                           "are kept in memory, the last "
                           f"{self.capacity}, and only with store: true)", param)
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


STORE = web.AppKey("responses", ResponseStore)


def _part_text(content, field: str) -> str:
    """A message's content: a string, or input_text / output_text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, "invalid_request", "content must be a string or a list of parts",
                       field)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            texts.append(part.get("text") or part.get("refusal") or "")
        else:
            raise ApiError(400, "invalid_request", f"content parts of type {kind!r} are not "
                           "supported: this server serves text models", f"{field}.{j}")
    return "\n".join(texts)


def input_messages(body: ResponsesRequest) -> list[dict]:
    """The request's own input items as chat messages (instructions not included)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict] = []
    reasoning: list[str] = []  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(body.input):
        field = f"input.{i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, "invalid_request", "role must be user, system, developer "
                               f"or assistant, got {role!r}", f"{field}.role")
            out.append({"role": role, "content": _part_text(item.get("content", ""),
                                                            f"{field}.content")})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"], reasoning = "\n".join(reasoning), []
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments", "")}}
            if not isinstance(call["id"], str) or not isinstance(call["function"]["name"], str):
                raise ApiError(400, "invalid_request", "a function_call item needs call_id "
                               "and name", field)
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning:
                    out[-1]["reasoning_content"], reasoning = "\n".join(reasoning), []
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _part_text(output, f"{field}.output")})
        elif kind == "reasoning":  # reasoning_content of the assistant turn that follows:
            # the template decides (most drop it; gpt-oss keeps it before a call)
            reasoning += [part["text"] for part in (item.get("content") or item.get("summary")
                                                    or []) if isinstance(part, dict)
                          and isinstance(part.get("text"), str)]
        else:
            raise ApiError(400, "invalid_request", f"input items of type {kind!r} are not "
                           "supported", f"{field}.type")
    return out


def _tools(body: ResponsesRequest) -> list[dict] | None:
    if not body.tools:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        kind = tool.get("type")
        if kind != "function":
            name = kind if kind in BUILT_IN_TOOLS else repr(kind)
            raise ApiError(400, "unsupported_parameter", f"the built-in tool {name} is not "
                           "supported by this server: only function tools", f"tools.{i}")
        tools.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters", "strict")
            if key in tool}})
    return tools


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, "unsupported_parameter", "tool_choice must be none, auto, required or "
                   "{\"type\": \"function\", \"name\": ...}", "tool_choice")


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            key: fmt[key] for key in ("name", "schema", "strict") if key in fmt}}
    return fmt  # json_object, or a type chat's check names


def as_chat(body: ResponsesRequest, history: tuple[dict, ...]) -> tuple[ChatCompletionRequest,
                                                                         list[dict]]:
    """-> (the chat request, the conversation so far as chat messages: the history, then
    this request's input; stored with the answer for a later previous_response_id)."""
    conversation = list(history) + input_messages(body)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions
                else []) + conversation
    effort = (body.reasoning or {}).get("effort")
    chat = validate_as(ChatCompletionRequest, {
        "model": body.model, "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
        "priority": body.priority,
        "logprobs": bool(body.top_logprobs), "top_logprobs": body.top_logprobs,
        "tools": _tools(body), "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text), "reasoning_effort": effort})
    return chat, conversation
