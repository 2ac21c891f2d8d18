"""Anthropic's Messages API through the `anthropic` SDK: messages.create and messages.stream
(text, thinking, a tool_use round trip, stop_sequences, max_tokens), count_tokens, the key in
x-api-key, and errors in Anthropic's shape. The tiny Qwen3-shaped model and its thinking
template are tests/test_chat_features.py's, with the model's first tokens scripted."""
from __future__ import annotations

import json

import pytest

from tests.server_util import request
from tests.test_chat_features import scripted_qwen3

anthropic = pytest.importorskip("anthropic")

KEY = "sk-test-messages"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv, script = scripted_qwen3(tmp_path_factory.mktemp("messages"), api_key=KEY)
    yield srv, script
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served[0].url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(served):
    return served[0].engine.model_name


USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_text_whole_and_streamed(served, client, model):
    _, script = served
    script.say("It is sunny.")
    whole = client.messages.create(model=model, max_tokens=50, messages=USER,
                                   system="Be brief.", thinking={"type": "disabled"})
    assert whole.type == "message" and whole.role == "assistant"
    assert [b.type for b in whole.content] == ["text"]
    assert whole.content[0].text == "It is sunny." and whole.stop_reason == "end_turn"
    counted = client.messages.count_tokens(model=model, messages=USER, system="Be brief.",
                                           thinking={"type": "disabled"})
    assert whole.usage.input_tokens == counted.input_tokens > 5
    assert whole.usage.output_tokens == len(served[1]._tokenizer.encode(
        "It is sunny.", add_special_tokens=False))
    with client.messages.stream(model=model, max_tokens=50, messages=USER, system="Be brief.",
                                thinking={"type": "disabled"}) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == "It is sunny." and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.count("message_stop") == 1 and "message_delta" in events
    assert events.index("content_block_start") < events.index("content_block_stop")


def test_thinking_is_a_block(served, client, model):
    _, script = served
    script.say("<think>Paris is in France.</think>Sunny.")
    whole = client.messages.create(model=model, max_tokens=80, messages=USER,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == "Paris is in France."
    assert whole.content[1].text == "Sunny."
    with client.messages.stream(model=model, max_tokens=80, messages=USER,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in final.content] == [("thinking", "Paris is in France."), ("text", "Sunny.")]


def test_tool_use_round_trip(served, client, model):
    srv, script = served
    script.say("Let me check.\n" + CALL)
    first = client.messages.create(model=model, max_tokens=80, messages=USER, tools=[WEATHER],
                                   thinking={"type": "disabled"})
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"]
    use = first.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id
    with client.messages.stream(model=model, max_tokens=80, messages=USER, tools=[WEATHER],
                                thinking={"type": "disabled"}) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta"
                          and e.delta.type == "input_json_delta")
        streamed = stream.get_final_message()
    assert json.loads(partial) == {"city": "Paris"} and streamed.stop_reason == "tool_use"
    assert streamed.content[-1].input == {"city": "Paris"}
    script.say("It is 21 degrees in Paris.")
    history = USER + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "21 C and sunny"}]}]
    second = client.messages.create(model=model, max_tokens=80, messages=history,
                                    tools=[WEATHER], thinking={"type": "disabled"})
    assert second.content[0].text == "It is 21 degrees in Paris."
    assert second.stop_reason == "end_turn"
    longer = client.messages.count_tokens(model=model, messages=history, tools=[WEATHER])
    shorter = client.messages.count_tokens(model=model, messages=USER, tools=[WEATHER])
    assert longer.input_tokens > shorter.input_tokens  # the tool's result is in the prompt
    script.say('{"city": "Lyon"}')  # under the tool's grammar (tool_choice forces it)
    forced = client.messages.create(model=model, max_tokens=60, messages=USER, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    thinking={"type": "disabled"})
    assert forced.content[-1].type == "tool_use" and forced.content[-1].name == "get_weather"
    assert forced.content[-1].input == {"city": "Lyon"} and forced.stop_reason == "tool_use"


def test_stop_sequences_and_max_tokens(served, client, model):
    _, script = served
    script.say("one two three four")
    out = client.messages.create(model=model, max_tokens=50, messages=USER,
                                 stop_sequences=["three"], thinking={"type": "disabled"})
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "three"
    assert out.content[0].text == "one two "
    script.say("one two three four five six seven", stop=False)
    out = client.messages.create(model=model, max_tokens=2, messages=USER,
                                 thinking={"type": "disabled"})
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 2


def test_errors_in_anthropics_shape(served, client, model):
    srv, _ = served
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=5, messages=USER)
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=model, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=model, max_tokens=5, messages=USER, tools=[
            {"type": "web_search_20250305", "name": "web_search"}])
    assert "web_search" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus-4", max_tokens=5, messages=USER)
    status, _, raw = request(srv.port, "POST", "/v1/messages", {"messages": USER},
                             headers={"x-api-key": KEY})
    assert status == 400 and json.loads(raw) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: max_tokens is required"}}
