"""What agent frameworks send, through the `openai` package against a tiny Qwen3-shaped model
served with a thinking chat template written here (`--chat-template`): reasoning split into
`reasoning_content` (streamed and not; enable_thinking=False gives none; a tag never closed),
structured output applied after the reasoning, tool calls in the hermes, llama3_json and
mistral formats with streamed deltas that reassemble to the non-streamed calls, parallel calls
and parallel_tool_calls=false, and the chat template as server configuration: request-supplied
templates and reserved kwargs refused at once while another stream keeps its pace, a render
stopped past its time bound.

A random tiny model writes no tags of its own, so the model's first tokens are scripted: the
engine's sampled token is replaced by the script's while it lasts (everything else, the
forward included, runs as served), then the model goes on (under a grammar where one is set)
or stops at the script's end."""
from __future__ import annotations

import json
import random
import threading
import time

import pytest

from tritonserve.server.common import STATE
from tritonserve.server.reasoning import ReasoningSplitter, pick_parser
from tritonserve.server import tool_parsers
from tests.server_util import ServerThread, request
from tests.tiny_models import write_tiny_model

THINKING_TEMPLATE = """\
{%- if slow %}{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}\
{% endif %}
{%- if tools %}<|im_start|>system
You may call tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>
{% endif %}
{%- if reasoning_effort is defined %}<|im_start|>system
Reasoning: {{ reasoning_effort }}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}


class Script:
    """The next requests' first output tokens: `text` tokenized, then EOS (stop=True) or the
    model's own tokens."""

    def __init__(self, engine) -> None:
        self.ids: list[int] = []
        self.stop = True
        self.eos = engine.tokenizer.eos_token_id
        self._tokenizer = engine.tokenizer
        original = engine._on_token

        def scripted(request, sampled, now):
            position = request.num_output_tokens
            if position < len(self.ids):
                sampled = type(sampled)(self.ids[position], sampled.logprob, None)
            elif self.stop and self.ids:
                sampled = type(sampled)(self.eos, sampled.logprob, None)
            return original(request, sampled, now)

        engine._on_token = scripted

    def say(self, text: str, stop: bool = True) -> None:
        self.ids = self._tokenizer.encode(text, add_special_tokens=False)
        self.stop = stop


def scripted_qwen3(folder, **server_options) -> tuple[ServerThread, Script]:
    """A server on a tiny Qwen3-shaped model with THINKING_TEMPLATE, its output scripted
    (tests/test_anthropic_messages.py and tests/test_responses_api.py use it too)."""
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    model = write_tiny_model(folder / "model", "Qwen3ForCausalLM", seed=3)
    template = folder / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    engine = LLMEngine(build_config(str(model)))
    script = Script(engine)
    return ServerThread(engine, chat_template=str(template), **server_options), script


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    srv, script = scripted_qwen3(tmp_path_factory.mktemp("qwen3-thinking"),
                                 chat_template_timeout=0.5)
    yield srv, script
    srv.stop()


@pytest.fixture(scope="module")
def client(qwen3):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=qwen3[0].url + "/v1", api_key="unused", max_retries=0)


def ask(client, **options):
    options.setdefault("messages", [{"role": "user", "content": "What is 2 + 2?"}])
    options.setdefault("max_tokens", 300)
    return client.chat.completions.create(model=client.models.list().data[0].id, **options)


def gathered(chunks) -> dict:
    """A stream's deltas joined: reasoning, content, calls by index, finish_reason."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            out["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, {"id": None, "name": None,
                                                             "arguments": ""})
                if call.id:
                    assert entry["id"] is None, "a call's id and name come once"
                    entry["id"], entry["name"] = call.id, call.function.name
                entry["arguments"] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


# ---- reasoning -------------------------------------------------------------------------------
def test_reasoning_is_split_streamed_and_not(qwen3, client):
    srv, script = qwen3
    assert srv.app[STATE].template.reasoning_parser == "qwen3"  # picked from the template
    script.say("<think>\nTwo and two.\n</think>\n\nIt is 4.")
    message = ask(client).choices[0].message
    assert message.reasoning_content == "\nTwo and two.\n" and message.content == "It is 4."
    streamed = gathered(ask(client, stream=True))
    assert (streamed["reasoning"], streamed["content"]) == ("\nTwo and two.\n", "It is 4.")
    assert streamed["finish"] == "stop"


def test_enable_thinking_false_gives_no_reasoning(qwen3, client):
    srv, script = qwen3
    script.say("It is 4.")
    out = ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.content == "It is 4."
    assert out.choices[0].message.reasoning_content is None
    thinking = ask(client).usage.prompt_tokens
    assert out.usage.prompt_tokens > thinking  # the template wrote the empty think block


def test_a_tag_never_closed_is_all_reasoning(qwen3, client):
    _, script = qwen3
    script.say("<think>\nstill thinking about it and more", stop=False)
    out = ask(client, max_tokens=12)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.reasoning_content


def test_structured_output_applies_after_the_reasoning(qwen3, client):
    _, script = qwen3
    script.say("<think>\nyes or no?\n</think>", stop=False)  # then the model, under a grammar
    out = ask(client, extra_body={"structured_outputs": {"regex": "(yes|no)!"}})
    message = out.choices[0].message
    assert message.reasoning_content == "\nyes or no?\n"
    assert message.content in ("yes!", "no!")


def test_reasoning_effort_reaches_a_template_that_reads_it(qwen3, client):
    _, script = qwen3
    script.say("ok")
    plain = ask(client).usage.prompt_tokens
    assert ask(client, reasoning_effort="high").usage.prompt_tokens > plain
    status, _, raw = request(qwen3[0].port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "maximal"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "reasoning_effort"


def test_the_splitter_finds_the_tag_wherever_the_tokens_cut_it():
    text = "  <think>a</thi</think>nk>b</think>\n\ncontent </think> stays"
    whole = ReasoningSplitter("qwen3", "x").split_all(text)
    assert (whole.reasoning, whole.content) == ("a</thi", "nk>b</think>\n\ncontent </think> stays")
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 10)))
        splitter, got = ReasoningSplitter("qwen3", "x"), ["", ""]
        for piece in [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]:
            part = splitter.feed(piece)
            got[0] += part.reasoning
            got[1] += part.content
        last = splitter.finish()
        assert [got[0] + last.reasoning, got[1] + last.content] == [whole.reasoning,
                                                                     whole.content]
    assert pick_parser(THINKING_TEMPLATE) == "qwen3" and pick_parser("{{ messages }}") is None
    assert ReasoningSplitter("deepseek_r1", "").split_all("r</think>c").reasoning == "r"


# ---- tool calls ------------------------------------------------------------------------------
CALLS = {
    "hermes": 'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
              '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
              '{"tz": "CET"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "get_time", "parameters": {"tz": "CET"}}',
    "mistral": 'Checking both. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
               '"Paris"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]',
}


@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_tool_calls_in_each_format_stream_as_deltas(qwen3, client, fmt):
    srv, script = qwen3
    template = srv.app[STATE].template
    template.tool_parser, before = fmt, template.tool_parser
    try:
        script.say(f"<think>\nneeds tools\n</think>\n\n{CALLS[fmt]}")
        out = ask(client, tools=[WEATHER, TIME]).choices[0]
        assert out.finish_reason == "tool_calls"
        assert out.message.reasoning_content == "\nneeds tools\n"
        assert out.message.content == (None if fmt == "llama3_json" else "Checking both.")
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in out.message.tool_calls]
        assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
        streamed = gathered(ask(client, tools=[WEATHER, TIME], stream=True))
        assert streamed["finish"] == "tool_calls"
        assert streamed["content"] == (out.message.content or "")
        assert [(c["name"], c["arguments"]) for _, c in sorted(streamed["calls"].items())] == \
            [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
        assert all(c["id"] for c in streamed["calls"].values())
    finally:
        template.tool_parser = before


def test_arguments_arrive_in_pieces_and_parallel_false_keeps_one_call(qwen3, client):
    _, script = qwen3
    script.say(CALLS["hermes"])
    chunks = list(ask(client, tools=[WEATHER, TIME], stream=True))
    pieces = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []
              if c.index == 0 and not c.id]
    assert len(pieces) > 2  # the arguments, written token by token
    out = ask(client, tools=[WEATHER, TIME], parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in out.message.tool_calls] == ["get_weather"]
    streamed = gathered(ask(client, tools=[WEATHER, TIME], parallel_tool_calls=False,
                            stream=True))
    assert [c["name"] for c in streamed["calls"].values()] == ["get_weather"]


def test_a_malformed_call_ends_as_content(qwen3, client):
    _, script = qwen3
    broken = '<tool_call>\n{"name": get_weather}\n</tool_call>'
    script.say(broken)
    out = ask(client, tools=[WEATHER]).choices[0]
    assert out.finish_reason == "stop" and out.message.tool_calls is None
    assert out.message.content == broken


def test_the_parser_follows_the_template():
    assert tool_parsers.pick_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert tool_parsers.pick_parser("Environment: ipython <|python_tag|>") == "llama3_json"
    assert tool_parsers.pick_parser(THINKING_TEMPLATE) == "hermes"


# ---- the template is server configuration ------------------------------------------------------
def _pace_while(srv, action):
    """Runs `action` while a long stream runs; -> (action's result, its seconds, the stream's
    largest gap between tokens in seconds)."""
    arrivals: list[float] = []

    def stream() -> None:
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("POST", "/generate", body=json.dumps({
            "prompt": "a b c", "max_tokens": 150, "ignore_eos": True, "stream": True}),
            headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        while line := response.readline():
            if line.startswith(b"data: "):
                arrivals.append(time.monotonic())
        conn.close()

    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(0.3)
    started = time.monotonic()
    result = action()
    took = time.monotonic() - started
    reader.join(60)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return result, took, max(gaps)


def test_a_request_supplied_template_is_refused_at_once(qwen3):
    srv, script = qwen3
    script.ids = []
    evil = "{% for _ in range(10**9) %}x{% endfor %}"
    (status, _, raw), took, gap = _pace_while(srv, lambda: request(
        srv.port, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"chat_template": evil}}))
    assert status == 400 and took < 1.0 and gap < 1.0
    assert json.loads(raw)["error"]["param"] == "chat_template_kwargs.chat_template"
    for body, param in (({"chat_template": evil}, "chat_template"),
                        ({"chat_template_kwargs": {"add_generation_prompt": False}},
                         "chat_template_kwargs.add_generation_prompt"),
                        ({"chat_template_kwargs": {"messages": []}},
                         "chat_template_kwargs.messages")):
        status, _, raw = request(srv.port, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], **body})
        assert status == 400 and json.loads(raw)["error"]["param"] == param


def test_a_render_past_its_time_bound_is_stopped(qwen3):
    srv, script = qwen3
    script.ids = []
    (status, _, raw), took, gap = _pace_while(srv, lambda: request(
        srv.port, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"slow": True}}))
    assert status == 400 and "0.5 s" in json.loads(raw)["error"]["message"]
    assert took < 3.0 and gap < 1.0  # 0.5 s bound; the other stream kept its pace
    status, _, _ = request(srv.port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200  # the worker is free again


def test_a_missing_template_file_is_refused_at_start(tmp_path):
    from tritonserve.server.chat_template import ChatTemplate
    with pytest.raises(ValueError, match="chat_template: no file"):
        ChatTemplate.load(str(tmp_path / "none.jinja"), None, 1.0)


def test_the_conformance_reasoning_check_passes_here(qwen3):
    import asyncio
    from tritonserve.bench.conformance import run_checks
    srv, script = qwen3
    script.say("<think>\nTwo and two.\n</think>\n\nIt is 4.")
    (result,) = asyncio.run(run_checks(srv.url, "openai", only=["openai_reasoning_fields"]))
    assert result.status == "pass", result.evidence
