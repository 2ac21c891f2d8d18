"""OpenAI's Responses API through the `openai` SDK: responses.create and responses.stream with
text, instructions, reasoning items, a function-call round trip (by input items and by
previous_response_id), text.format json_schema (responses.parse too), max_output_tokens,
the stored response (GET, store: false, DELETE) and 400s naming built-in tools. The tiny
Qwen3-shaped model and its thinking template are tests/test_chat_features.py's, with the
model's first tokens scripted."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from tests.server_util import request
from tests.test_chat_features import scripted_qwen3

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv, script = scripted_qwen3(tmp_path_factory.mktemp("responses"), responses_store=4)
    yield srv, script
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(served):
    return served[0].engine.model_name


def test_text_whole_and_streamed(served, client, model):
    srv, script = served
    script.say("<think></think>It is sunny.")
    whole = client.responses.create(model=model, input="Weather in Paris?",
                                    instructions="Be brief.")
    assert whole.status == "completed" and whole.output_text == "It is sunny."
    assert [item.type for item in whole.output] == ["message"]
    assert whole.usage.output_tokens > 3 and whole.usage.input_tokens > 5
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    with client.responses.stream(model=model, input="Weather in Paris?",
                                 instructions="Be brief.") as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == "It is sunny."
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and kinds.count("response.completed") == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == "It is sunny."
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.done")


def test_reasoning_is_an_item(served, client, model):
    _, script = served
    script.say("<think>Paris is in France.</think>Sunny.")
    whole = client.responses.create(model=model, input="Weather in Paris?")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "Paris is in France."
    assert whole.output_text == "Sunny."
    with client.responses.stream(model=model, input="Weather in Paris?") as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert deltas == "Paris is in France." and final.output_text == "Sunny."


def test_function_call_round_trip(served, client, model):
    _, script = served
    script.say("<think></think>" + CALL)
    first = client.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER])
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].call_id
    with client.responses.stream(model=model, input="Weather in Paris?",
                                 tools=[WEATHER]) as stream:
        arguments = "".join(e.delta for e in stream
                            if e.type == "response.function_call_arguments.delta")
        streamed = stream.get_final_response()
    assert json.loads(arguments) == {"city": "Paris"}
    assert [i.type for i in streamed.output][-1] == "function_call"
    result = {"type": "function_call_output", "call_id": calls[0].call_id,
              "output": "21 C and sunny"}
    script.say("<think></think>21 degrees.")
    by_items = client.responses.create(model=model, tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in first.output], result])
    assert by_items.output_text == "21 degrees."
    by_id = client.responses.create(model=model, tools=[WEATHER], input=[result],
                                    previous_response_id=first.id)
    assert by_id.output_text == "21 degrees."
    assert by_id.usage.input_tokens == by_items.usage.input_tokens  # the same conversation


class Answer(BaseModel):
    answer: int


def test_json_schema_format(served, client, model):
    _, script = served
    script.say('<think></think>{"answer": 4}')
    parsed = client.responses.parse(model=model, input="2 + 2?", text_format=Answer)
    assert parsed.output_parsed == Answer(answer=4)
    script.say('<think></think>{"answer": 5}')
    with client.responses.stream(model=model, input="2 + 3?", text_format=Answer) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == Answer(answer=5)


def test_max_output_tokens_is_incomplete(served, client, model):
    _, script = served
    script.say("<think></think>one two three four five six seven eight", stop=False)
    out = client.responses.create(model=model, input="Count", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3


def test_the_store(served, client, model):
    srv, script = served
    script.say("<think></think>Kept.")
    kept = client.responses.create(model=model, input="hi")
    assert client.responses.retrieve(kept.id).output_text == "Kept."
    gone = client.responses.create(model=model, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    made = [client.responses.create(model=model, input="hi") for _ in range(6)]
    with pytest.raises(openai.NotFoundError) as err:  # the store keeps the last 4
        client.responses.create(model=model, input="again", previous_response_id=made[1].id)
    assert err.value.body["param"] == "previous_response_id"
    assert [client.responses.retrieve(r.id).id for r in made[2:]] == [r.id for r in made[2:]]


def test_refusals_name_the_field(served, client, model):
    srv, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, input="hi", tools=[{"type": "web_search"}])
    assert "web_search" in str(err.value)
    status, _, raw = request(srv.port, "POST", "/v1/responses", {
        "input": "hi", "background": True})
    assert status == 400 and json.loads(raw)["error"]["param"] == "background"
    status, _, raw = request(srv.port, "POST", "/v1/responses", {
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "input.0.content.0"
