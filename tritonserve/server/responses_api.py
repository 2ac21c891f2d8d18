"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

The request becomes a chat request (server/responses_input.py) and goes through chat's
preparation; the output is ChatOutput's as output items: `reasoning`, `message` (one
output_text part) and `function_call` (server/blocks.py). A stream sends typed events, each
with its `event:` name and a sequence_number: response.created, response.in_progress, then
per item output_item.added, its deltas (reasoning_text.delta, content_part.added +
output_text.delta, function_call_arguments.delta), their .done events and output_item.done,
and one terminal event: response.completed, response.incomplete (max_output_tokens) or
response.failed. A response with `store` (the default) is kept for GET and for a later
request's previous_response_id.
"""
from __future__ import annotations

import time

from aiohttp import web

from tritonserve.engine import FinishReason

from .blocks import REASONING, TEXT, Block, BlockEvent, BlockStream, blocks_of
from .chat_output import ChatOutput
from .chat_prepare import PreparedChat, prepare_chat
from .common import NamedEvent
from .driver import Choice, Payload, Renderer, respond
from .responses_input import STORE, ResponseStore, ResponsesRequest, Stored, as_chat
from .routes_openai import lora_of, opened, started

UNSUPPORTED = ("background", "conversation", "prompt", "max_tool_calls")


def _item_id(response_id: str, block: Block) -> str:
    prefix = {REASONING: "rs", TEXT: "msg"}.get(block.kind, "fc")
    return f"{prefix}_{response_id.split('_', 1)[-1]}_{block.index}"


class ResponsesRenderer(Renderer):
    def __init__(self, state, request_id: str, body: ResponsesRequest, chat: PreparedChat,
                 conversation: list[dict], store) -> None:
        self.id = request_id
        self.body = body
        self.created = int(time.time())
        self.model = body.model or state.engine.card.name
        self.prompt_tokens = len(chat.prompt_ids)
        self.conversation = conversation
        self.store = store if body.store else None
        self._output = lambda: ChatOutput(chat.template.reasoning_parser, chat.prompt_text,
                                          chat.plan)
        self.stream_output = self._output()
        self.blocks = BlockStream()
        self.sequence = 0

    # ---- the objects ---------------------------------------------------------------------
    def _item(self, block: Block, done: bool) -> dict:
        status = "completed" if done else "in_progress"
        item_id = _item_id(self.id, block)
        if block.kind == REASONING:
            return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": block.text}] if done else []}
        if block.kind == TEXT:
            return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                    "content": [self._part(block.text)] if done else []}
        return {"type": "function_call", "id": item_id, "call_id": block.call_id,
                "name": block.name, "arguments": block.text if done else "", "status": status}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _response(self, status: str, blocks: list[Block] = (), completion=None,
                  error: dict | None = None) -> dict:
        body = self.body
        fmt = (body.text or {}).get("format") or {"type": "text"}
        usage = None
        if completion is not None:
            usage = {"input_tokens": self.prompt_tokens, "output_tokens":
                     completion.output_tokens,
                     "total_tokens": self.prompt_tokens + completion.output_tokens,
                     "input_tokens_details": {"cached_tokens": completion.cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": [self._item(b, True) for b in blocks],
            "usage": usage, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": fmt}, "reasoning": body.reasoning, "metadata": body.metadata or {},
            "truncation": body.truncation or "disabled", "user": body.user}

    def _finished(self, blocks: list[Block], completion) -> dict:
        status = "incomplete" if completion.reason is FinishReason.LENGTH else "completed"
        response = self._response(status, blocks, completion)
        if self.store is not None:
            answer = {"role": "assistant",
                      "content": "".join(b.text for b in blocks if b.kind == TEXT)}
            calls = [{"id": b.call_id, "type": "function",
                      "function": {"name": b.name, "arguments": b.text}}
                     for b in blocks if b.kind not in (REASONING, TEXT)]
            if calls:
                answer["tool_calls"] = calls
            thinking = "".join(b.text for b in blocks if b.kind == REASONING)
            if thinking:  # the template decides (gpt-oss keeps it before a call)
                answer["reasoning_content"] = thinking
            self.store.put(Stored(response, (*self.conversation, answer)))
        return response

    # ---- the stream ----------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> NamedEvent:
        self.sequence += 1
        return NamedEvent(kind, {"type": kind, "sequence_number": self.sequence - 1, **fields})

    def _events(self, events: list[BlockEvent]) -> list[Payload]:
        out: list[Payload] = []
        for e in events:
            block, where = e.block, {"item_id": _item_id(self.id, e.block),
                                     "output_index": e.block.index}
            if e.what == "start":
                out.append(self._event("response.output_item.added",
                                       output_index=block.index,
                                       item=self._item(block, False)))
                if block.kind == TEXT:
                    out.append(self._event("response.content_part.added", **where,
                                           content_index=0, part=self._part("")))
            elif e.what == "delta" and block.kind == REASONING:
                out.append(self._event("response.reasoning_text.delta", **where,
                                       content_index=0, delta=e.delta))
            elif e.what == "delta" and block.kind == TEXT:
                out.append(self._event("response.output_text.delta", **where, content_index=0,
                                       delta=e.delta, logprobs=[]))
            elif e.what == "delta":
                out.append(self._event("response.function_call_arguments.delta", **where,
                                       delta=e.delta))
            else:
                out.extend(self._closing(block, where))
        return out

    def _closing(self, block: Block, where: dict) -> list[Payload]:
        out = []
        if block.kind == REASONING:
            out.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                   text=block.text))
        elif block.kind == TEXT:
            out.append(self._event("response.output_text.done", **where, content_index=0,
                                   text=block.text, logprobs=[]))
            out.append(self._event("response.content_part.done", **where, content_index=0,
                                   part=self._part(block.text)))
        else:
            out.append(self._event("response.function_call_arguments.done", **where,
                                   name=block.name, arguments=block.text))
        out.append(self._event("response.output_item.done", output_index=block.index,
                               item=self._item(block, True)))
        return out

    def start(self) -> list[Payload]:
        shell = self._response("in_progress")
        return [self._event("response.created", response=shell),
                self._event("response.in_progress", response=shell)]

    def token(self, index, token) -> list[Payload]:
        return self._events(self.blocks.feed(self.stream_output.delta(token.text)))

    def finish(self, index, completion) -> list[Payload]:
        delta = self.stream_output.final_delta(completion.tail_text)
        out = self._events(self.blocks.feed(delta) + self.blocks.finish())
        response = self._finished(self.blocks.blocks, completion)
        kind = "response.incomplete" if response["status"] == "incomplete" \
            else "response.completed"
        return out + [self._event(kind, response=response)]

    def failure(self, failure) -> list[Payload]:
        error = {"code": "server_error", "message": f"{failure.code}: {failure.message}"}
        return [self._event("response.failed", response=self._response(
            "failed", self.blocks.blocks, error=error))]

    def response(self, choices: list[Choice]) -> dict:
        choice = choices[0]
        blocks = blocks_of(self._output().message(choice.text))
        return self._finished(blocks, choice.completion)


async def create(request: web.Request) -> web.StreamResponse:
    state, arrival, body = await opened(request, ResponsesRequest, UNSUPPORTED)
    store = request.app[STORE]
    history = ()
    if body.previous_response_id is not None:
        history = store.get(body.previous_response_id, "previous_response_id").messages
    chat_body, conversation = as_chat(body, history)
    chat = await prepare_chat(state, chat_body)
    request_id = started(request, "resp")
    items = await state.engine.submit(request_id, [chat.prompt_ids], chat.params, arrival,
                                      lora=lora_of(state, body.model))
    renderer = ResponsesRenderer(state, request_id, body, chat, conversation, store)
    return await respond(request, request_id, items, renderer, bool(body.stream))


async def retrieve(request: web.Request) -> web.Response:
    return web.json_response(request.app[STORE].get(request.match_info["id"]).response)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["id"]
    request.app[STORE].delete(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


def add_routes(app: web.Application, capacity: int = 1024) -> None:
    app[STORE] = ResponseStore(capacity)
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{id}", retrieve)
    app.router.add_delete("/v1/responses/{id}", delete)
