"""Conformance checks for the OpenAI streaming dialect (docs/conformance.md)."""
from __future__ import annotations

import json

from .checks_native import INVALID_BODIES, require
from .http import post
from .validator import OpenAIValidator


def _body(ctx, chat: bool, **extra) -> dict:
    body = {"max_tokens": 8, "temperature": 0, **extra}
    if ctx.model:
        body["model"] = ctx.model
    if chat:
        body["messages"] = [{"role": "user", "content": "Say hello."}]
    else:
        body["prompt"] = "Hello, my name is"
    return body


async def _openai_stream(ctx, chat: bool, include_usage: bool, **extra):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _body(ctx, chat, stream=True, **extra)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    reply = await post(ctx.session, ctx.base_url + path, body)
    require(reply.status == 200, f"HTTP {reply.status}: {reply.raw[:200]!r}")
    validator = OpenAIValidator(chat=chat, expect_usage=include_usage)
    payloads = reply.payloads
    for payload in payloads:
        validator.feed(payload)
    verdict = validator.finish()
    require(verdict.protocol_error is None, verdict.protocol_error or "")
    require(verdict.error is None, f"error payload: {verdict.error}")
    return verdict, payloads


async def openai_completions_framing(ctx) -> str:
    verdict, payloads = await _openai_stream(ctx, chat=False, include_usage=False)
    require(payloads[-1] == "[DONE]", "[DONE] is not last")
    require(all("usage" not in json.loads(p) or json.loads(p)["usage"] is None
                for p in payloads[:-1]), "usage sent although not asked for")
    return f"{len(payloads)} frames, one finish_reason ({verdict.finish_reason}), [DONE] last"


async def openai_chat_framing(ctx) -> str:
    verdict, payloads = await _openai_stream(ctx, chat=True, include_usage=False)
    first = json.loads(payloads[0])
    require(first["choices"][0]["delta"].get("role") == "assistant",
            "the first chat chunk does not carry role=assistant")
    return f"{len(payloads)} frames, one finish_reason ({verdict.finish_reason}), [DONE] last"


async def openai_usage_when_asked(ctx) -> str:
    for chat in (False, True):
        verdict, payloads = await _openai_stream(ctx, chat=chat, include_usage=True)
        last = json.loads(payloads[-2])
        require(last.get("choices") == [] and last.get("usage"),
                "the chunk before [DONE] is not the usage chunk with no choices")
        require(verdict.server_output_tokens >= verdict.client_output_tokens,
                "usage counts fewer tokens than chunks seen")
    return "include_usage: a final usage chunk, consistent with the chunks seen"


async def openai_non_stream_usage(ctx) -> str:
    for chat, path in ((False, "/v1/completions"), (True, "/v1/chat/completions")):
        reply = await post(ctx.session, ctx.base_url + path, _body(ctx, chat))
        require(reply.status == 200, f"{path}: HTTP {reply.status}")
        usage = reply.json().get("usage") or {}
        require(usage.get("total_tokens") == usage.get("prompt_tokens", 0) +
                usage.get("completion_tokens", 0) and usage.get("completion_tokens"),
                f"{path}: usage missing or inconsistent: {usage}")
        require(reply.json()["choices"][0]["finish_reason"] in ("stop", "length"),
                f"{path}: finish_reason {reply.json()['choices'][0]['finish_reason']!r}")
    return "usage present and consistent on both non-streaming routes"


async def openai_invalid_bodies(ctx) -> str:
    bodies = INVALID_BODIES
    for name, raw in bodies.items():
        reply = await post(ctx.session, ctx.base_url + "/v1/completions", raw)
        require(400 <= reply.status < 500, f"{name}: HTTP {reply.status}")
        require(b"data:" not in reply.raw, f"{name}: SSE bytes in the error response")
        require("error" in reply.json(), f"{name}: no 'error' in the body")
    return f"{len(bodies)} bad bodies: 4xx JSON errors"


async def openai_stream_matches_non_stream(ctx) -> str:
    verdict, _ = await _openai_stream(ctx, chat=False, include_usage=True)
    reply = await post(ctx.session, ctx.base_url + "/v1/completions", _body(ctx, False))
    full = reply.json()
    require(full["choices"][0]["text"] == verdict.text,
            f"text differs: {full['choices'][0]['text']!r} vs {verdict.text!r}")
    require(full["usage"]["completion_tokens"] == verdict.server_output_tokens,
            "completion_tokens differ")
    return f"greedy: same text and {verdict.server_output_tokens} completion tokens"


CHECKS = [openai_completions_framing, openai_chat_framing, openai_usage_when_asked,
          openai_non_stream_usage, openai_invalid_bodies, openai_stream_matches_non_stream]
