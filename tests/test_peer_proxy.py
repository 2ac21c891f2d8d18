"""bench/peer_proxy.py's usage chunk: a stream that sends no usage gets one before [DONE],
counting its token chunks (an empty text too); a stream with its own usage passes unchanged."""
from __future__ import annotations

import json

from tritonserve.bench.peer_proxy import UsageCounter


def sse(data) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n"


def run(lines: list[bytes]) -> list[bytes]:
    counter = UsageCounter()
    return [out for line in lines for out in counter.feed(line)]


def test_a_stream_without_usage_gets_the_count_of_its_token_chunks():
    chunks = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]}
              for t in ("<unused_7>", " a", "", "b")]  # "": a token ending mid-character
    chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    lines = [line for c in chunks for line in (sse(c), b"\n")] + [sse(b"[DONE]"), b"\n"]
    out = run(lines)
    assert out[:len(lines) - 2] == lines[:-2]
    usage = json.loads(out[-3][len(b"data: "):])
    assert usage == {"choices": [], "usage": {"completion_tokens": 4}}
    assert out[-2:] == lines[-2:]


def test_a_stream_with_usage_passes_unchanged():
    lines = [sse({"choices": [{"index": 0, "text": "x", "finish_reason": None}]}), b"\n",
             sse({"choices": [], "usage": {"completion_tokens": 1}}), b"\n",
             sse(b"[DONE]"), b"\n", b": a comment\n"]
    assert run(lines) == lines
