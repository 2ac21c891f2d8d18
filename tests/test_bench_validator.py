"""The bench's validators on crafted streams, one per rule: each recorded exactly as expected."""
from __future__ import annotations

import json

import pytest

from tritonserve.bench.validator import NativeValidator, OpenAIValidator

TIMING = {"ttft_ms": 1.0, "total_ms": 5.0, "queue_wait_ms": 0.5, "execution_ms": 4.5,
          "tokens_per_s": 400.0}


def token(i, text="x", token_id=7):
    return {"type": "token", "index": i, "text": text, "token_id": token_id}


def done(n, reason="length", **over):
    return {"type": "done", "finish_reason": reason, "prompt_tokens": 3, "output_tokens": n,
            "text": "", **TIMING, **over}


def run_native(events):
    v = NativeValidator()
    for e in events:
        v.feed(e if isinstance(e, str) else json.dumps(e))
    return v.finish()


CASES = [
    ("skipped index", [token(0), token(2), done(2)], "skipped token index"),
    ("duplicate index", [token(0), token(0), done(2)], "duplicate token index"),
    ("count mismatch", [token(0), token(1), done(3)], "done.output_tokens is 3"),
    ("event after done", [token(0), done(1), token(1)], "event after the terminal"),
    ("two terminals", [token(0), done(1), done(1)], "event after the terminal"),
    ("no terminal", [token(0), token(1)], "without a terminal event"),
    ("null timing", [token(0), done(1, ttft_ms=None)], "ttft_ms"),
    ("missing timing", [token(0), {k: v for k, v in done(1).items() if k != "total_ms"}],
     "total_ms"),
    ("unknown field", [dict(token(0), is_last=True), done(1)], "is_last"),
    ("not json", ["{oops", done(0)], "does not match the schema"),
    ("error then token", [{"type": "error", "code": "x", "message": "y"}, token(0)],
     "event after the terminal"),
]


@pytest.mark.parametrize("name,events,expected", CASES, ids=[c[0] for c in CASES])
def test_each_rule_is_a_protocol_error(name, events, expected):
    verdict = run_native(events)
    assert verdict.protocol_error is not None and expected in verdict.protocol_error


def test_error_event_is_the_requests_error_not_a_protocol_error():
    verdict = run_native([token(0), {"type": "error", "code": "engine_error",
                                     "message": "boom"}])
    assert verdict.protocol_error is None
    assert verdict.error == "engine_error: boom"


def test_valid_stream_with_empty_texts_and_eos_at_the_last_permitted_step():
    # max_tokens was 3: two tokens (one with empty text), then EOS at the last step
    verdict = run_native([token(0, ""), token(1, "hi"), done(2, reason="eos")])
    assert verdict.protocol_error is None and verdict.error is None
    assert verdict.finish_reason == "eos"
    assert verdict.server_output_tokens == verdict.client_output_tokens == 2
    assert verdict.text == "hi"


def openai_stream(chunks, usage=None, done=True):
    out = [json.dumps({"choices": [c]}) for c in chunks]
    if usage:
        out.append(json.dumps({"choices": [], "usage": usage}))
    if done:
        out.append("[DONE]")
    return out


def run_openai(payloads, chat=False, expect_usage=True):
    v = OpenAIValidator(chat=chat, expect_usage=expect_usage)
    for p in payloads:
        v.feed(p)
    return v.finish()


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def choice(text, finish=None):
    return {"index": 0, "text": text, "finish_reason": finish}


def test_openai_valid():
    v = run_openai(openai_stream([choice("a"), choice("b"), choice("", "stop")], USAGE))
    assert v.protocol_error is None and v.server_output_tokens == 2 and v.text == "ab"


@pytest.mark.parametrize("payloads,expected", [
    (openai_stream([choice("a"), choice("b", "stop")], USAGE, done=False), "without [DONE]"),
    (openai_stream([choice("a"), choice("b", "stop")], USAGE) + ["{}"], "after [DONE]"),
    (openai_stream([choice("a"), choice("b")], USAGE), "0 chunks carried a finish_reason"),
    (openai_stream([choice("a", "stop"), choice("b", "stop")], USAGE), "2 chunks"),
    (openai_stream([choice("a"), choice("b", "length")]), "usage was asked for"),
    (openai_stream([choice("a"), choice("b"), choice("c"), choice("", "length")], USAGE),
     "below the 3 token chunks"),
    (openai_stream([choice("a"), choice("", "stop")], {**USAGE, "total_tokens": 9}),
     "does not add up"),
])
def test_openai_rules(payloads, expected):
    verdict = run_openai(payloads)
    assert verdict.protocol_error is not None and expected in verdict.protocol_error


def test_openai_error_payload_is_the_requests_error():
    verdict = run_openai([json.dumps({"choices": [choice("a")]}),
                          json.dumps({"error": {"code": "engine_error", "message": "boom"}}),
                          "[DONE]"])
    assert verdict.error == "engine_error: boom" and verdict.protocol_error is None
