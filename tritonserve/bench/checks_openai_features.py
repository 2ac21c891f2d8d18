"""Conformance checks for the OpenAI features clients send (docs/conformance.md): n choices,
a list of prompts, logprobs, response_format json_schema, a named tool call, and the error
shape. Each runs against any OpenAI-compatible server (this one, vLLM)."""
from __future__ import annotations

import json

from .checks_native import require
from .http import post

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}}}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}}


def _with_model(ctx, body: dict) -> dict:
    return {**body, "model": ctx.model} if ctx.model else body


async def _completions(ctx, **body):
    reply = await post(ctx.session, ctx.base_url + "/v1/completions",
                       _with_model(ctx, {"max_tokens": 6, **body}))
    require(reply.status == 200, f"HTTP {reply.status}: {reply.raw[:200]!r}")
    return reply.json()


async def _chat(ctx, **body):
    messages = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
    reply = await post(ctx.session, ctx.base_url + "/v1/chat/completions",
                       _with_model(ctx, {"messages": messages, "max_tokens": 60, **body}))
    require(reply.status == 200, f"HTTP {reply.status}: {reply.raw[:200]!r}")
    return reply.json()


async def openai_n_choices(ctx) -> str:
    full = await _completions(ctx, prompt="Once upon a time", n=3, temperature=1.0, seed=1)
    require(sorted(c["index"] for c in full["choices"]) == [0, 1, 2],
            f"indices {[c['index'] for c in full['choices']]}")
    reply = await post(ctx.session, ctx.base_url + "/v1/completions", _with_model(ctx, {
        "prompt": "Once upon a time", "n": 2, "max_tokens": 4, "stream": True}))
    finishes: dict[int, int] = {}
    for payload in reply.payloads[:-1]:
        for choice in json.loads(payload).get("choices", []):
            finishes[choice["index"]] = finishes.get(choice["index"], 0) + \
                (choice.get("finish_reason") is not None)
    require(finishes == {0: 1, 1: 1}, f"finish_reason chunks per choice: {finishes}")
    return "n=3: indices 0-2; streamed n=2: one finish_reason per choice"


async def openai_prompt_list(ctx) -> str:
    full = await _completions(ctx, prompt=["Hello", "The capital of France is"],
                              temperature=0)
    require([c["index"] for c in full["choices"]] == [0, 1],
            f"indices {[c['index'] for c in full['choices']]}")
    return "two prompts: two choices, in order"


async def openai_logprobs(ctx) -> str:
    full = await _completions(ctx, prompt="Hello", temperature=0, logprobs=2)
    lp = full["choices"][0]["logprobs"]
    require(lp is not None and len(lp["token_logprobs"]) == len(lp["tokens"]) > 0,
            f"logprobs {lp}")
    require(all(v <= 0 for v in lp["token_logprobs"]), "a logprob above 0")
    chat = await _chat(ctx, temperature=0, logprobs=True, top_logprobs=2, max_tokens=4)
    content = (chat["choices"][0].get("logprobs") or {}).get("content") or []
    require(content and all(len(t["top_logprobs"]) == 2 for t in content),
            f"chat logprobs {content[:1]}")
    return f"completions: {len(lp['tokens'])} tokens with logprobs; chat: top_logprobs=2"


async def openai_json_schema(ctx) -> str:
    chat = await _chat(ctx, temperature=1.0, seed=2, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    text = chat["choices"][0]["message"]["content"]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        require(False, f"not JSON: {text!r}")
    require(set(value) == {"answer", "sure"} and value["answer"] in ("yes", "no")
            and isinstance(value["sure"], bool), f"does not follow the schema: {text!r}")
    return f"json_schema output validates: {text}"


async def openai_named_tool_call(ctx) -> str:
    chat = await _chat(ctx, temperature=1.0, seed=3, tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    choice = chat["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    require(len(calls) == 1 and calls[0]["function"]["name"] == "get_weather",
            f"tool_calls {calls}")
    try:
        args = json.loads(calls[0]["function"]["arguments"])
    except json.JSONDecodeError:
        args = None
    require(isinstance(args, dict) and args.get("city") in ("Paris", "Oslo"),
            f"arguments {calls[0]['function']['arguments']!r}")
    return f"tool_calls[0]: get_weather({calls[0]['function']['arguments']}), " \
           f"finish_reason {choice['finish_reason']}"


async def openai_error_shape(ctx) -> str:
    seen = []
    for body in ({"prompt": "hi", "max_tokens": 2, "bogus_field": 1},
                 {"prompt": "hi", "max_tokens": 2, "temperature": -1}):
        reply = await post(ctx.session, ctx.base_url + "/v1/completions",
                           _with_model(ctx, body))
        require(reply.status == 400, f"HTTP {reply.status} for {body}")
        error = reply.json().get("error")
        require(isinstance(error, dict) and isinstance(error.get("message"), str),
                f"error body {reply.raw[:200]!r}")
        seen.append(f"{error.get('type')}/param={error.get('param')}")
    return "400 with {error: {message, type, param, code}}: " + ", ".join(seen)


CHECKS = [openai_n_choices, openai_prompt_list, openai_logprobs, openai_json_schema,
          openai_named_tool_call, openai_error_shape]
