"""The official openai client against /v1/completions and /v1/chat/completions."""
from __future__ import annotations

import json

import pytest

from tests.server_util import request, sse_payloads


def test_completions_non_streaming(client, server):
    out = client.completions.create(model=server.engine.model_name, prompt="Hello world",
                                    max_tokens=6, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.completion_tokens == 6 or out.choices[0].finish_reason == "stop"
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completions_streaming_with_usage(client, server):
    chunks = list(client.completions.create(
        model=server.engine.model_name, prompt="Hello world", max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes.count(None) == len(finishes) - 1 and finishes[-1] in ("length", "stop")
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    full = client.completions.create(model=server.engine.model_name, prompt="Hello world",
                                     max_tokens=6, temperature=0)
    assert text == full.choices[0].text
    token_chunks = sum(1 for c in chunks if c.choices and c.choices[0].finish_reason is None)
    assert chunks[-1].usage.completion_tokens == token_chunks


def test_chat_streaming_and_not(client, server):
    messages = [{"role": "user", "content": "Say hello"}]
    full = client.chat.completions.create(model=server.engine.model_name, messages=messages,
                                          max_tokens=5, temperature=0)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=server.engine.model_name,
                                                 messages=messages, max_tokens=5,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks].count(None) == len(chunks) - 1


def test_done_sentinel_is_last_and_usage_only_when_asked(server):
    status, _, raw = request(server.port, "POST", "/v1/completions",
                             {"prompt": "hi", "max_tokens": 3, "stream": True})
    payloads = sse_payloads(raw)
    assert status == 200 and payloads[-1] == "[DONE]"
    assert all("usage" not in p for p in payloads[:-1])


def test_openai_errors(server, client):
    import openai
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.engine.model_name, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    status, _, raw = request(server.port, "POST", "/v1/chat/completions",
                             {"messages": [], "max_tokens": 2})
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages"


def test_logprobs_on_completions(client, server):
    out = client.completions.create(model=server.engine.model_name, prompt="Hello",
                                    max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(len(t) <= 2 for t in lp.top_logprobs)
