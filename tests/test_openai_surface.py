"""What OpenAI clients really send, through the official `openai` package: lists of prompts,
n, text content parts, "max_tokens": null, echo, /tokenize, /detokenize, /version, and a 400
naming every documented field that is not served yet. Also: the n choices of a prompt prefill
it once, and the server reaches the engine through one door."""
from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import pytest

from tests.server_util import request, sse_payloads

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(server):
    return server.engine.model_name


def greedy_text(client, model, prompt, max_tokens=5) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_list_of_prompts_gives_one_choice_each(client, model, server):
    out = client.completions.create(model=model, prompt=["Hello world", "The cat"],
                                    max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == greedy_text(client, model, "Hello world")
    assert out.choices[1].text == greedy_text(client, model, "The cat")
    encode = server.engine.tokenizer.encode
    assert out.usage.completion_tokens == 10
    assert out.usage.prompt_tokens == len(encode("Hello world")) + len(encode("The cat"))


def test_token_id_prompts(client, model, server):
    ids = server.engine.tokenizer.encode("Hello world")
    out = client.completions.create(model=model, prompt=[ids, ids[:2]], max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert len(out.choices) == 2
    assert out.choices[0].text == greedy_text(client, model, "Hello world", 3)


def test_n_choices_completions_streamed_and_not(client, model):
    out = client.completions.create(model=model, prompt="Once upon", n=3, max_tokens=6,
                                    temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18
    texts = [c.text for c in out.choices]
    assert len(set(texts)) > 1  # seed + j per choice: not three copies of one draw
    again = client.completions.create(model=model, prompt="Once upon", n=3, max_tokens=6,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == texts  # seeded: reproducible
    chunks = list(client.completions.create(
        model=model, prompt="Once upon", n=3, max_tokens=6, temperature=1.0, seed=7,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    streamed = {i: "" for i in range(3)}
    finishes = {i: 0 for i in range(3)}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            finishes[choice.index] += choice.finish_reason is not None
    assert finishes == {0: 1, 1: 1, 2: 1}
    assert [streamed[i] for i in range(3)] == texts
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens  # the prompt counts once


def test_n_choices_chat_streamed_and_not(client, model):
    messages = [{"role": "user", "content": "Say hello"}]
    full = client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=4,
                                          temperature=0)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.choices[0].message.content == full.choices[1].message.content  # greedy
    chunks = list(client.chat.completions.create(model=model, messages=messages, n=2,
                                                 max_tokens=4, temperature=0, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]  # the first chunk of each choice names the role
    text = {0: "", 1: ""}
    for c in chunks:
        text[c.choices[0].index] += c.choices[0].delta.content or ""
    assert text[0] == full.choices[0].message.content == text[1]


def test_chat_text_content_parts_and_null_max_tokens(client, model, server):
    plain = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello"}], max_tokens=4,
        temperature=0)
    parts = client.chat.completions.create(
        model=model, messages=[{"role": "user",
                                "content": [{"type": "text", "text": "Say hello"}]}],
        max_tokens=4, temperature=0)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    status, _, raw = request(server.port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": None, "temperature": 0,
        "max_completion_tokens": 3})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] <= 3
    status, _, raw = request(server.port, "POST", "/v1/completions", {
        "prompt": "hi", "max_tokens": None, "temperature": None, "ignore_eos": True})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 16  # default
    status, _, raw = request(server.port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert status == 400 and json.loads(raw)["error"]["param"].startswith("messages.0.content")


def test_echo_prepends_the_prompt(client, model):
    out = client.completions.create(model=model, prompt="Hello world", max_tokens=3,
                                    temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert out.choices[0].text == "Hello world" + greedy_text(client, model, "Hello world", 3)
    chunks = list(client.completions.create(model=model, prompt="Hello world", max_tokens=3,
                                            temperature=0, echo=True, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


@pytest.mark.parametrize("route,field,value", [
    ("/v1/chat/completions", "audio", {"voice": "alloy"}),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "reasoning_effort", "low"),
    ("/v1/completions", "suffix", "end"),
    ("/v1/completions", "best_of", 3),
])
def test_documented_but_unserved_fields_name_themselves(server, route, field, value):
    body = {"max_tokens": 2, field: value}
    body.update({"prompt": "hi"} if route == "/v1/completions"
                else {"messages": [{"role": "user", "content": "hi"}]})
    status, _, raw = request(server.port, "POST", route, body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == field and error["code"] == "unsupported_parameter"


def test_harmless_defaults_are_accepted(server):
    status, _, _ = request(server.port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tool_choice": "none",
        "store": False, "user": "u1", "parallel_tool_calls": True, "seed": 3})
    assert status == 200


def test_undocumented_fields_still_get_a_400(server):
    status, _, raw = request(server.port, "POST", "/v1/completions",
                             {"prompt": "hi", "max_tokens": 2, "frobnicate": 1})
    assert status == 400 and json.loads(raw)["error"]["param"] == "frobnicate"


def test_tokenize_detokenize_version(server):
    status, _, raw = request(server.port, "POST", "/tokenize", {"prompt": "Hello world"})
    body = json.loads(raw)
    assert status == 200 and body["tokens"] == server.engine.tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    status, _, raw = request(server.port, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and json.loads(raw)["prompt"].strip() == "Hello world"
    status, _, raw = request(server.port, "POST", "/tokenize",
                             {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and json.loads(raw)["count"] > 1
    status, _, raw = request(server.port, "POST", "/detokenize", {"tokens": [10 ** 9]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "tokens"
    status, _, raw = request(server.port, "POST", "/tokenize", {})
    assert status == 400
    status, _, raw = request(server.port, "GET", "/version")
    assert status == 200 and re.match(r"\d", json.loads(raw)["version"])
    plan = json.loads(raw)["decode_plan"]  # what this server's steps run, and why
    assert set(plan) == {"mode", "weights", "attention", "draw", "why_mode", "why_weights",
                         "dense_above"}
    assert plan["mode"] in ("layers", "compile", "eager") and plan["why_mode"]


def test_n_choices_prefill_the_prompt_once(tiny_model):
    """The siblings wait for the first one's prefill, then take its blocks from the cache."""
    from tritonserve.engine import LLMEngine, SamplingParams
    from tritonserve.engine.llm import build_config
    engine = LLMEngine(build_config(tiny_model))
    scheduled = []
    execute = engine.runner.execute

    def spy(schedule):
        scheduled.append([(s.request.request_id, s.start, s.num_new_tokens)
                          for s in schedule.scheduled])
        return execute(schedule)
    engine.runner.execute = spy
    prompt = list(range(5, 5 + 40))  # 2 full blocks of 16 and 8 tokens
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request(prompt, params, "a")
    engine.add_request(prompt, params, "b", prefill_after="a")
    engine.add_request(prompt, params, "c", prefill_after="a")
    while engine.has_unfinished_requests():
        engine.step()
    assert scheduled[0] == [("a", 0, 40)]  # b and c wait for a's prefill
    second = {rid: (start, n) for rid, start, n in scheduled[1]}
    assert second["b"] == (32, 8) and second["c"] == (32, 8)  # the two full blocks are reused
    prefill_tokens = sum(n for step in scheduled for _, _, n in step if n > 1)
    assert prefill_tokens == 40 + 8 + 8


def test_the_server_reaches_the_engine_through_one_door():
    """Only server/async_engine.py touches LLMEngine; routes, metrics and __main__ use the
    AsyncEngine's card, stats, prompts and submit."""
    for path in (ROOT / "tritonserve" / "server").glob("*.py"):
        if path.name == "async_engine.py":
            continue
        text = path.read_text()
        assert not re.search(r"\.engine\.engine\b|async_engine\.engine\b", text), path.name


def test_cli_defaults_come_from_the_configs():
    from tritonserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from tritonserve.server.__main__ import parse_args, server_config
    from tritonserve.server.config import ServerConfig
    args = parse_args([])
    assert server_config(args) == ServerConfig()
    assert args.max_num_seqs == SchedulerConfig.max_num_seqs
    assert args.max_num_batched_tokens == SchedulerConfig.max_num_batched_tokens
    assert args.block_size == CacheConfig.block_size and args.cache_bytes == CacheConfig.cache_bytes
    for f in fields(EngineConfig):
        if hasattr(args, f.name) and f.name != "model":
            assert getattr(args, f.name) == f.default, f.name


def test_sampling_ranges_come_from_sampling_params(server):
    """The schema has types only; the range and the message are SamplingParams' own."""
    from tritonserve.engine import InvalidRequestError, SamplingParams
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(top_p=1.5)
    status, _, raw = request(server.port, "POST", "/v1/completions",
                             {"prompt": "hi", "top_p": 1.5})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "top_p" and error["message"] == str(exc.value)
    payloads = sse_payloads(request(server.port, "POST", "/generate",
                                    {"prompt": "hi", "max_tokens": 2, "stream": True})[2])
    assert payloads[-1]["type"] == "done"


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(client, server):
    """usage.prompt_tokens_details.cached_tokens: 0 for a new prompt, its full blocks (16
    tokens each) when the same prompt comes again; streamed usage says the same."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 6 + "unique tail 7931"
    first = client.completions.create(model=server.engine.model_name, prompt=prompt,
                                      max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=server.engine.model_name, prompt=prompt,
                                       max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached <= second.usage.prompt_tokens
    chunks = list(client.completions.create(
        model=server.engine.model_name, prompt=prompt, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello there", "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}]})])
def test_continuous_usage_stats_put_usage_so_far_in_every_chunk(server, path, body):
    """stream_options.continuous_usage_stats (with include_usage): each chunk carries its
    choice's usage so far, the tokens counted as they stream; the last usage chunk as before."""
    status, _, raw = request(server.port, "POST", path, {
        **body, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert status == 200
    chunks = [p for p in sse_payloads(raw) if p != "[DONE]"]
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5 * body.get("n", 1)
    seen: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        usage, index = chunk["usage"], chunk["choices"][0]["index"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens"] == final["usage"]["prompt_tokens"]  # one prompt
        seen.setdefault(index, []).append(usage["completion_tokens"])
    for counts in seen.values():  # rising one a token chunk, ending at the choice's tokens
        assert counts == sorted(counts) and counts[-1] == 5, counts
    status, _, raw = request(server.port, "POST", path, {
        **body, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
    assert all(p["usage"] is None for p in sse_payloads(raw)[:-2])  # off: null as before
