"""Conformance checks for the native token/done/error protocol (docs/conformance.md)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from .http import post
from .validator import NativeValidator, StreamVerdict

REPLACEMENT = "\ufffd"
PROBE_PROMPTS = ["Hello", "The capital of France is", "Write one short sentence.",
                 "1, 2, 3,", "Say goodbye.", "Once upon a time"]


class CheckFailed(AssertionError):
    pass


class Skipped(Exception):
    pass


def require(condition: bool, evidence: str) -> None:
    if not condition:
        raise CheckFailed(evidence)


@dataclass
class NativeStream:
    verdict: StreamVerdict
    events: list[dict]

    @property
    def tokens(self) -> list[dict]:
        return [e for e in self.events if e.get("type") == "token"]


async def native_stream(ctx, **body) -> NativeStream:
    reply = await post(ctx.session, ctx.base_url + "/generate", {**body, "stream": True})
    require(reply.status == 200, f"HTTP {reply.status}: {reply.raw[:200]!r}")
    require(reply.content_type.startswith("text/event-stream"),
            f"content type {reply.content_type!r}")
    validator = NativeValidator()
    events = []
    for payload in reply.payloads:
        validator.feed(payload)
        try:
            events.append(json.loads(payload))
        except json.JSONDecodeError:
            events.append({})
    return NativeStream(validator.finish(), events)


async def valid_stream(ctx, **body) -> NativeStream:
    stream = await native_stream(ctx, **body)
    require(stream.verdict.protocol_error is None, stream.verdict.protocol_error or "")
    require(stream.verdict.error is None, f"error event: {stream.verdict.error}")
    return stream


async def eos_probe(ctx) -> tuple[str, int]:
    """A prompt whose greedy continuation ends with EOS after n >= 1 tokens."""
    if "eos_probe" not in ctx.cache:
        found = None
        for prompt in PROBE_PROMPTS:
            stream = await valid_stream(ctx, prompt=prompt, max_tokens=64, temperature=0)
            v = stream.verdict
            if v.finish_reason == "eos" and v.server_output_tokens:
                found = (prompt, v.server_output_tokens)
                break
        ctx.cache["eos_probe"] = found
    if ctx.cache["eos_probe"] is None:
        raise Skipped("no probe prompt ends with EOS within 64 greedy tokens")
    return ctx.cache["eos_probe"]


async def plain_stream(ctx) -> str:
    stream = await valid_stream(ctx, prompt="Hello, how are you?", max_tokens=16,
                                temperature=0)
    return f"{len(stream.tokens)} token events, finish {stream.verdict.finish_reason}"


async def max_tokens_1(ctx) -> str:
    stream = await valid_stream(ctx, prompt="Hello", max_tokens=1, temperature=0,
                                ignore_eos=True)
    v = stream.verdict
    require(v.finish_reason == "length" and len(stream.tokens) == 1 and
            v.server_output_tokens == 1,
            f"finish {v.finish_reason} with {len(stream.tokens)} token events, "
            f"output_tokens {v.server_output_tokens}")
    return "one token event, then done(length, output_tokens=1)"


async def length_counts_every_token(ctx) -> str:
    for n in (2, 5, 9):
        stream = await valid_stream(ctx, prompt="Count with me:", max_tokens=n,
                                    temperature=0, ignore_eos=True)
        v = stream.verdict
        require(v.finish_reason == "length" and len(stream.tokens) == n,
                f"max_tokens={n} ended with {v.finish_reason} after {len(stream.tokens)} "
                "token events (the last token held back or dropped?)")
    return "max_tokens 2, 5, 9 gave exactly that many token events"


async def eos_before_max_tokens(ctx) -> str:
    prompt, n = await eos_probe(ctx)
    stream = await valid_stream(ctx, prompt=prompt, max_tokens=n + 10, temperature=0)
    v = stream.verdict
    require(v.finish_reason == "eos" and v.server_output_tokens == n == len(stream.tokens),
            f"expected eos after {n} tokens, got {v.finish_reason} after {len(stream.tokens)}")
    return f"{prompt!r}: {n} tokens, then done(eos); EOS itself not sent"


async def eos_at_last_permitted_step(ctx) -> str:
    prompt, n = await eos_probe(ctx)
    last = await valid_stream(ctx, prompt=prompt, max_tokens=n + 1, temperature=0)
    cut = await valid_stream(ctx, prompt=prompt, max_tokens=n, temperature=0)
    a, b = last.verdict, cut.verdict
    require(a.finish_reason == "eos" and len(last.tokens) == n,
            f"max_tokens={n + 1}: expected eos after {n} tokens, got {a.finish_reason} after "
            f"{len(last.tokens)}")
    require(b.finish_reason == "length" and len(cut.tokens) == n,
            f"max_tokens={n}: expected length after {n} tokens, got {b.finish_reason} after "
            f"{len(cut.tokens)}")
    return f"max_tokens={n + 1} -> eos, max_tokens={n} -> length, both with {n} tokens"


async def stop_string_spanning_tokens(ctx) -> str:
    base = await valid_stream(ctx, prompt="Tell me a story.", max_tokens=32, temperature=0,
                              ignore_eos=True)
    texts = [t.get("text", "") for t in base.tokens]
    full = "".join(texts)
    offset = 0
    for i in range(len(texts) - 1):
        offset += len(texts[i])
        a, b = texts[i], texts[i + 1]
        if a and b and (a[-1] + b[0]).isprintable() and REPLACEMENT not in a[-1] + b[0]:
            stop = a[-1] + b[0]
            if full.find(stop) == offset - 1:
                break
    else:
        raise Skipped("no token boundary between printable characters to span")
    stream = await valid_stream(ctx, prompt="Tell me a story.", max_tokens=32, temperature=0,
                                ignore_eos=True, stop=[stop])
    v = stream.verdict
    require(v.finish_reason == "stop", f"finish {v.finish_reason} with stop {stop!r}")
    require(v.text == full[:offset - 1], f"text {v.text!r} != {full[:offset - 1]!r}")
    return f"stop {stop!r} across tokens {i} and {i + 1}: text cut before it, finish stop"


async def multibyte_text(ctx) -> str:
    prompt = "你好，世界！😀 Écris en français, 日本語で: "
    for seed in range(6):
        body = dict(prompt=prompt, max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)
        stream = await valid_stream(ctx, **body)
        text = stream.verdict.text
        if not any(ord(c) > 127 and c != REPLACEMENT for c in text):
            continue
        reply = await post(ctx.session, ctx.base_url + "/generate", {**body, "stream": False})
        require(reply.status == 200, f"non-streaming HTTP {reply.status}")
        full = reply.json()["text"]
        require(text == full, f"streamed text {text!r} != non-streamed {full!r}")
        require(text.count(REPLACEMENT) == full.count(REPLACEMENT),
                "U+FFFD in token events that the final text does not have")
        return f"seed {seed}: {sum(ord(c) > 127 for c in text)} non-ASCII characters, adds up"
    raise Skipped("no sampled output contained a multi-byte character")


async def output_tokens_match_events(ctx) -> str:
    bodies = [dict(prompt="a", max_tokens=7, temperature=0.7, seed=1),
              dict(prompt="Hello there", max_tokens=12, temperature=0),
              dict(prompt="x y z", max_tokens=3, temperature=1.2, seed=5, top_k=5)]
    for body in bodies:
        stream = await valid_stream(ctx, **body)
        require(stream.verdict.server_output_tokens == len(stream.tokens),
                f"{body}: output_tokens {stream.verdict.server_output_tokens} vs "
                f"{len(stream.tokens)} events")
    return f"{len(bodies)} streams: output_tokens == token events"


async def timing_fields(ctx) -> str:
    stream = await valid_stream(ctx, prompt="Timing check", max_tokens=8, temperature=0)
    d = stream.verdict.done
    for key in ("ttft_ms", "total_ms", "queue_wait_ms", "execution_ms", "tokens_per_s"):
        require(d[key] >= 0, f"{key} is negative: {d[key]}")
    require(d["ttft_ms"] <= d["total_ms"] + 1e-6, f"ttft {d['ttft_ms']} > total {d['total_ms']}")
    gap = abs(d["queue_wait_ms"] + d["execution_ms"] - d["total_ms"])
    require(gap <= max(1.0, 0.01 * d["total_ms"]),
            f"queue_wait + execution differs from total by {gap:.3f} ms")
    return (f"ttft {d['ttft_ms']:.1f} <= total {d['total_ms']:.1f} ms; queue + execution "
            f"within {gap:.3f} ms")


async def concurrent_16(ctx) -> str:
    streams = await asyncio.gather(*(valid_stream(ctx, prompt=f"stream {i}", max_tokens=8,
                                                  temperature=0.8, seed=i)
                                     for i in range(16)))
    return f"16 concurrent streams valid ({sum(len(s.tokens) for s in streams)} tokens)"


async def client_disconnect(ctx) -> str:
    body = {"prompt": "Disconnect me", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with ctx.session.post(ctx.base_url + "/generate", json=body) as response:
        require(response.status == 200, f"HTTP {response.status}")
        await response.content.readuntil(b"\n\n")
        response.close()
    await asyncio.sleep(0.2)
    stream = await valid_stream(ctx, prompt="Still there?", max_tokens=4, temperature=0)
    return f"after a disconnect mid-stream, a new stream is valid ({len(stream.tokens)} tokens)"


INVALID_BODIES = {
    "unknown field": json.dumps({"prompt": "hi", "max_tokens": 2, "bogus": 1}).encode(),
    "wrong type": json.dumps({"prompt": "hi", "max_tokens": "two"}).encode(),
    "negative temperature": json.dumps({"prompt": "hi", "temperature": -1}).encode(),
    "max_tokens 0": json.dumps({"prompt": "hi", "max_tokens": 0}).encode(),
    "top_p above 1": json.dumps({"prompt": "hi", "top_p": 1.5}).encode(),
    "malformed JSON": b'{"prompt": "hi", ',
}


async def invalid_bodies(ctx) -> str:
    for name, raw in INVALID_BODIES.items():
        for stream in (True, False):
            body = raw
            if stream and raw.startswith(b"{") and raw.endswith(b"}"):
                body = json.dumps({**json.loads(raw), "stream": True}).encode()
            reply = await post(ctx.session, ctx.base_url + "/generate", body)
            require(400 <= reply.status < 500, f"{name}: HTTP {reply.status}")
            require(b"data:" not in reply.raw, f"{name}: SSE bytes in the error response")
            require(reply.content_type.startswith("application/json"),
                    f"{name}: content type {reply.content_type!r}")
            require("error" in reply.json(), f"{name}: no 'error' in {reply.raw[:100]!r}")
    return f"{len(INVALID_BODIES)} bad bodies x stream on/off: 4xx JSON, no SSE"


async def stream_matches_non_stream(ctx) -> str:
    body = dict(prompt="Compare me", max_tokens=16, temperature=0)
    stream = await valid_stream(ctx, **body)
    reply = await post(ctx.session, ctx.base_url + "/generate", {**body, "stream": False})
    require(reply.status == 200, f"non-streaming HTTP {reply.status}")
    full = reply.json()
    v = stream.verdict
    require(full["text"] == v.text, f"text differs: {full['text']!r} vs {v.text!r}")
    require(full["output_tokens"] == v.server_output_tokens and
            full["finish_reason"] == v.finish_reason, "counts or finish_reason differ")
    return f"greedy: same text, {v.server_output_tokens} tokens, finish {v.finish_reason}"


CHECKS = [plain_stream, max_tokens_1, length_counts_every_token, eos_before_max_tokens,
          eos_at_last_permitted_step, stop_string_spanning_tokens, multibyte_text,
          output_tokens_match_events, timing_fields, concurrent_16, client_disconnect,
          invalid_bodies, stream_matches_non_stream]
