"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, for Claude Code
and Anthropic-SDK agents.

A request is translated into a chat request (server/messages_input.py: system, text blocks,
tool_use as the assistant's tool_calls, tool_result as tool messages, tools as functions,
tool_choice auto / any / tool / none, stop_sequences, thinking as the template's
enable_thinking) and goes through the same preparation as chat (server/chat_prepare.py: template, tool grammar, limits). The output is
ChatOutput's (reasoning split off, tool calls parsed) as content blocks: `thinking`, `text`,
`tool_use` (server/blocks.py). Streams send message_start, content_block_start / delta / stop
per block, message_delta (stop_reason, usage) and message_stop, each with its `event:` name; a
failure mid-stream is an `error` event. Errors have Anthropic's shape (app.error_dialect).

Not served: images and documents (a 400 naming the block), server tools (web search, bash,
text editor: a 400 naming the tool). thinking.budget_tokens is accepted but not enforced.
"""
from __future__ import annotations

import json

from aiohttp import web

from tritonserve.engine import FinishReason

from .blocks import REASONING, TEXT, Block, BlockEvent, BlockStream, blocks_of
from .chat_output import ChatOutput
from .chat_prepare import PreparedChat, prepare_chat
from .common import ApiError, NamedEvent
from .driver import Choice, Payload, Renderer, respond
from .messages_input import MessagesRequest, as_chat
from .routes_openai import lora_of, opened, started


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
    items = await state.engine.submit(request_id, [chat.prompt_ids], chat.params, arrival,
                                      lora=lora_of(state, body.model))
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
