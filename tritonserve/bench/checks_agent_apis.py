"""Conformance checks for the streams agents read (docs/conformance.md): OpenAI's Responses
API and Anthropic's Messages API. Each frame's `event:` name equals its data's `type`; the
events come in their documented order (an item or block opened before its deltas, closed
before the next opens); exactly one terminal event, last; the streamed text equals the
non-streamed answer of the same greedy request; usage adds up. A server without the route
(HTTP 404) is a SKIP."""
from __future__ import annotations

import json

from .checks_native import Skipped, require
from .http import post

QUESTION = "Say hello."
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


async def _post(ctx, path: str, body: dict):
    if ctx.model:
        body = {**body, "model": ctx.model}
    reply = await post(ctx.session, ctx.base_url + path, body)
    if reply.status == 404 and b"model" not in reply.raw:
        raise Skipped(f"{path} is not served (HTTP 404)")
    require(reply.status == 200, f"HTTP {reply.status}: {reply.raw[:200]!r}")
    return reply


def _typed(reply) -> list[dict]:
    """The frames' data, each checked to carry its event name as its type."""
    out = []
    for name, data in reply.events:
        event = json.loads(data)
        require(name == event.get("type"), f"event name {name!r} != data type "
                f"{event.get('type')!r}")
        out.append(event)
    require(out, "an empty stream")
    return out


async def responses_stream_events(ctx) -> str:
    body = {"input": QUESTION, "max_output_tokens": 8, "temperature": 0}
    whole = (await _post(ctx, "/v1/responses", body)).json()
    events = _typed(await _post(ctx, "/v1/responses", {**body, "stream": True}))
    kinds = [e["type"] for e in events]
    require(kinds[0] == "response.created", f"the first event is {kinds[0]}")
    terminals = [k for k in kinds if k in TERMINAL]
    require(len(terminals) == 1 and kinds[-1] == terminals[0],
            f"terminal events {terminals}, last {kinds[-1]}")
    require([e.get("sequence_number") for e in events] == list(range(len(events))),
            "sequence_number is not 0, 1, 2, ...")
    opened: dict[int, str] = {}
    done: set[int] = set()
    text = ""
    for e in events[:-1]:
        kind, index = e["type"], e.get("output_index")
        if kind == "response.output_item.added":
            require(index not in opened, f"output_index {index} added twice")
            require(all(i in done for i in opened), "an item added before the last one ended")
            opened[index] = e["item"]["id"]
        elif kind == "response.output_item.done":
            require(opened.get(index) == e["item"]["id"], f"item {index} done, never added")
            done.add(index)
        elif index is not None:
            require(index in opened and index not in done and e["item_id"] == opened[index],
                    f"{kind} for item {index} outside its added / done")
        if kind == "response.output_text.delta":
            text += e["delta"]
    require(set(opened) == done, f"items never done: {set(opened) - done}")
    final = events[-1]["response"]
    require(final["status"] in ("completed", "incomplete"), f"status {final['status']}")
    usage = final.get("usage") or {}
    require(usage.get("total_tokens") == usage.get("input_tokens", 0)
            + usage.get("output_tokens", 0) and 0 < usage.get("output_tokens", 0) <= 8,
            f"usage {usage}")
    whole_text = "".join(part.get("text", "") for item in whole["output"]
                         if item["type"] == "message" for part in item["content"])
    require(text == whole_text, f"streamed {text!r} != non-streamed {whole_text!r}")
    require(whole["usage"]["output_tokens"] == usage["output_tokens"],
            "output_tokens differ between the stream and the answer")
    return f"{len(events)} events, one terminal ({terminals[0]}), items opened and closed in " \
           f"order, text = the non-streamed answer, usage {usage['output_tokens']} out"


async def messages_stream_events(ctx) -> str:
    body = {"max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}]}
    whole = (await _post(ctx, "/v1/messages", body)).json()
    events = _typed(await _post(ctx, "/v1/messages", {**body, "stream": True}))
    kinds = [e["type"] for e in events if e["type"] != "ping"]
    require(kinds[0] == "message_start" and kinds[-1] == "message_stop"
            and kinds.count("message_stop") == 1,
            f"first {kinds[0]}, last {kinds[-1]}, {kinds.count('message_stop')} message_stop")
    require(kinds.count("message_delta") == 1 and kinds[-2] == "message_delta",
            "one message_delta, right before message_stop")
    require(not any(e["type"] == "error" for e in events), "an error event")
    open_index, closed, text = None, [], ""
    for e in events:
        if e["type"] == "content_block_start":
            require(open_index is None, "a block started before the last one stopped")
            require(e["index"] == len(closed), f"block index {e['index']}, "
                    f"expected {len(closed)}")
            open_index = e["index"]
        elif e["type"] == "content_block_delta":
            require(e["index"] == open_index, f"a delta for block {e['index']} not open")
            text += e["delta"].get("text", "")
        elif e["type"] == "content_block_stop":
            require(e["index"] == open_index, f"stop for block {e['index']} not open")
            closed.append(open_index)
            open_index = None
    require(open_index is None, "a block never stopped")
    delta = next(e for e in events if e["type"] == "message_delta")
    require(delta["delta"].get("stop_reason") in ("end_turn", "max_tokens", "stop_sequence",
                                                  "tool_use"), f"stop_reason {delta['delta']}")
    out_tokens = (delta.get("usage") or {}).get("output_tokens")
    require(out_tokens == whole["usage"]["output_tokens"] and 0 < out_tokens <= 8,
            f"message_delta output_tokens {out_tokens}, the answer's "
            f"{whole['usage']['output_tokens']}")
    whole_text = "".join(b.get("text", "") for b in whole["content"] if b["type"] == "text")
    require(text == whole_text, f"streamed {text!r} != non-streamed {whole_text!r}")
    require(delta["delta"]["stop_reason"] == whole["stop_reason"], "stop_reason differs")
    return f"{len(kinds)} events: message_start, {len(closed)} block(s) started and stopped " \
           f"in order, one message_delta ({delta['delta']['stop_reason']}), message_stop " \
           f"last; text = the non-streamed answer"


async def messages_error_shape(ctx) -> str:
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": "many"}
    reply = await post(ctx.session, ctx.base_url + "/v1/messages",
                       {**body, "model": ctx.model} if ctx.model else body)
    if reply.status == 404:
        raise Skipped("/v1/messages is not served (HTTP 404)")
    require(400 <= reply.status < 500, f"HTTP {reply.status} for a bad max_tokens")
    body = reply.json()
    require(body.get("type") == "error" and isinstance(body.get("error"), dict)
            and body["error"].get("type") == "invalid_request_error",
            f"not Anthropic's error shape: {body}")
    return f"HTTP {reply.status}, {{type: error, error: {{type: invalid_request_error}}}}"


CHECKS = [responses_stream_events, messages_stream_events, messages_error_shape]
