"""Conformance checks for what agent frameworks and operators send (docs/conformance.md):
streamed tool-call deltas that reassemble to the non-streamed call, reasoning fields where the
server splits them, the caller's request id, and the 401 of a server with an API key. Each runs
against any OpenAI-compatible server (this one, vLLM); a check whose feature the server or its
model does not offer says so (SKIP)."""
from __future__ import annotations

import json

import aiohttp

from .checks_native import Skipped, require
from .checks_openai_features import TOOL, _with_model
from .http import post

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


async def _chat_raw(ctx, headers: dict | None = None, **body):
    return await post(ctx.session, ctx.base_url + "/v1/chat/completions",
                      _with_model(ctx, {"messages": QUESTION, "max_tokens": 60, **body}),
                      headers)


def _deltas(reply) -> list[dict]:
    out = []
    for payload in reply.payloads:
        if payload == "[DONE]":
            continue
        for choice in json.loads(payload).get("choices", []):
            out.append(choice)
    return out


async def openai_streamed_tool_deltas(ctx) -> str:
    named = {"tools": [TOOL], "tool_choice": {"type": "function",
                                              "function": {"name": "get_weather"}},
             "temperature": 0}
    whole = await _chat_raw(ctx, **named)
    require(whole.status == 200, f"HTTP {whole.status}: {whole.raw[:200]!r}")
    calls = whole.json()["choices"][0]["message"].get("tool_calls") or []
    require(len(calls) == 1, f"non-streamed tool_calls {calls}")
    call = calls[0]
    stream = await _chat_raw(ctx, stream=True, **named)
    pieces = [tc for choice in _deltas(stream)
              for tc in (choice.get("delta") or {}).get("tool_calls") or []]
    require(pieces, "no delta.tool_calls in the stream")
    ids = [p["id"] for p in pieces if p.get("id")]
    names = [p["function"]["name"] for p in pieces if (p.get("function") or {}).get("name")]
    require(len(ids) == 1 and names == ["get_weather"],
            f"the call's id and name must come once: ids {ids}, names {names}")
    require({p.get("index") for p in pieces} == {0}, "every delta of one call has index 0")
    arguments = "".join((p.get("function") or {}).get("arguments") or "" for p in pieces)
    require(_parsed(arguments) == _parsed(call["function"]["arguments"]) is not None,
            f"streamed arguments {arguments!r} != non-streamed "
            f"{call['function']['arguments']!r}")
    return f"{len(pieces)} deltas: id and name once, arguments reassembled = the " \
           f"non-streamed call ({arguments})"


def _parsed(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


async def openai_reasoning_fields(ctx) -> str:
    whole = await _chat_raw(ctx, temperature=0, max_tokens=200)
    require(whole.status == 200, f"HTTP {whole.status}: {whole.raw[:200]!r}")
    message = whole.json()["choices"][0]["message"]
    field = next((f for f in ("reasoning_content", "reasoning") if message.get(f)), None)
    if field is None:
        raise Skipped("no reasoning in the answer (the model or server splits none)")
    stream = await _chat_raw(ctx, temperature=0, max_tokens=200, stream=True)
    streamed = "".join((c.get("delta") or {}).get(field) or "" for c in _deltas(stream))
    content = "".join((c.get("delta") or {}).get("content") or "" for c in _deltas(stream))
    require(streamed == message[field], f"streamed {field} differs from the message's")
    require(content == (message.get("content") or ""), "streamed content differs")
    require("</think>" not in streamed + content, "a think tag leaked into the fields")
    return f"{field}: {len(streamed)} characters, streamed = non-streamed; content apart"


async def openai_request_id(ctx) -> str:
    ident = "conformance-42"
    reply = await _chat_raw(ctx, headers={"X-Request-Id": ident}, max_tokens=2)
    require(reply.status == 200, f"HTTP {reply.status}: {reply.raw[:200]!r}")
    echoed = reply.headers.get("x-request-id")
    require(echoed == ident, f"X-Request-Id not echoed (got {echoed!r})")
    body_id = reply.json().get("id", "")
    require(ident in body_id, f"the body's id {body_id!r} does not carry it")
    return f"X-Request-Id echoed; body id {body_id}"


async def openai_auth(ctx) -> str:
    if not ctx.api_key:
        raise Skipped("no --api-key given: the server's key is unknown")
    async with aiohttp.ClientSession() as bare:  # no key
        reply = await post(bare, ctx.base_url + "/v1/chat/completions",
                           _with_model(ctx, {"messages": QUESTION, "max_tokens": 2}))
    require(reply.status == 401, f"HTTP {reply.status} without the key")
    error = reply.json().get("error")
    require(isinstance(error, dict) and isinstance(error.get("message"), str),
            f"401 body {reply.raw[:200]!r} is not OpenAI's {{error: {{message, type, ...}}}}")
    ok = await _chat_raw(ctx, max_tokens=2)
    require(ok.status == 200, f"HTTP {ok.status} with the key")
    return f"401 {{error: {{type: {error.get('type')}, code: {error.get('code')}}}}} " \
           "without the key, 200 with it"


CHECKS = [openai_streamed_tool_deltas, openai_reasoning_fields, openai_request_id,
          openai_auth]
