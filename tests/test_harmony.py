"""gpt-oss's harmony format through the chat API (server/harmony.py): a tiny random gpt-oss
model with harmony's special tokens and a harmony-shaped chat template written here, its
output scripted (tests/test_chat_features.py's Script): the analysis channel is
reasoning_content, the final channel content, a commentary message to `functions.NAME` a tool
call with finish_reason tool_calls, streamed and not alike; a grammar applies to the final
channel; an earlier turn's reasoning and a call's JSON-string arguments reach the template as
it reads them; the parser finds every marker wherever the tokens cut it."""
from __future__ import annotations

import json
import random

import pytest

from tritonserve.server.chat_template import ChatTemplate
from tritonserve.server.common import STATE
from tritonserve.server.harmony import HarmonyStream, is_harmony
from tritonserve.server.schema import ChatCompletionRequest
from tests.server_util import ServerThread, request
from tests.test_chat_features import TIME, WEATHER, Script, ask, gathered
from tests.tiny_models import write_tiny_model

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>")
# the shape of gpt-oss's own template (system, developer with the tools, the turns, a call as a
# commentary message to functions.NAME, the generation prompt `<|start|>assistant`)
HARMONY_TEMPLATE = """\
<|start|>system<|message|>You are a test model.
Reasoning: {{ reasoning_effort if reasoning_effort is defined else "medium" }}

# Valid channels: analysis, commentary, final.<|end|>
{%- if tools %}<|start|>developer<|message|># Tools
namespace functions {
{%- for t in tools %}
type {{ t.function.name }} = (_: any) => any;
{%- endfor %}
} // namespace functions<|end|>{% endif %}
{%- set last = namespace(name="") %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>\
{% endif %}
{%- set call = m.tool_calls[0].function %}{% set last.name = call.name %}\
<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>\
{{ call.arguments | tojson }}<|call|>
{%- elif m.role == "assistant" %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}\
<|end|>
{%- elif m.role == "tool" %}<|start|>functions.{{ last.name }} to=assistant<|channel|>\
commentary<|message|>{{ m.content | tojson }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

ANALYSIS = "<|channel|>analysis<|message|>The user wants weather.<|end|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    folder = tmp_path_factory.mktemp("gpt-oss-harmony")
    model = write_tiny_model(folder / "model", "GptOssForCausalLM", seed=5,
                             special=HARMONY_TOKENS)
    template = folder / "harmony.jinja"
    template.write_text(HARMONY_TEMPLATE)
    engine = LLMEngine(build_config(str(model)))
    script = Script(engine)
    srv = ServerThread(engine, chat_template=str(template))
    yield srv, script
    srv.stop()


@pytest.fixture(scope="module")
def client(gpt_oss):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=gpt_oss[0].url + "/v1", api_key="unused", max_retries=0)


def test_analysis_is_reasoning_and_final_is_content(gpt_oss, client):
    srv, script = gpt_oss
    template = srv.app[STATE].template
    assert (template.reasoning_parser, template.tool_parser) == ("openai_gptoss", "openai")
    script.say(ANALYSIS + FINAL)
    choice = ask(client).choices[0]
    assert choice.message.reasoning_content == "The user wants weather."
    assert choice.message.content == "It is sunny." and choice.finish_reason == "stop"
    streamed = gathered(ask(client, stream=True))
    assert (streamed["reasoning"], streamed["content"]) == ("The user wants weather.",
                                                            "It is sunny.")
    assert streamed["finish"] == "stop"


def test_a_commentary_message_to_a_function_is_a_tool_call(gpt_oss, client):
    _, script = gpt_oss
    script.say(ANALYSIS + CALL)
    choice = ask(client, tools=[WEATHER, TIME]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "The user wants weather."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                        {"city": "Paris"})
    streamed = gathered(ask(client, tools=[WEATHER, TIME], stream=True))
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        ("get_weather", '{"city": "Paris"}')]
    # without tools in the request the same message is the model's own business: reasoning
    script.say(ANALYSIS + CALL)
    choice = ask(client).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.reasoning_content == 'The user wants weather.\n\n{"city": "Paris"}'


def test_a_grammar_applies_to_the_final_channel(gpt_oss, client):
    _, script = gpt_oss
    script.say(ANALYSIS + "<|start|>assistant<|channel|>final<|message|>", stop=False)
    out = ask(client, max_tokens=60, extra_body={"structured_outputs": {"regex": "(yes|no)!"}})
    message = out.choices[0].message
    assert message.reasoning_content == "The user wants weather."
    assert message.content in ("yes!", "no!")


def test_forced_tool_choice_is_refused_for_harmony(gpt_oss):
    status, _, raw = request(gpt_oss[0].port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
        "tool_choice": "required"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "tool_choice"


def test_an_earlier_turn_reaches_the_template_as_it_reads_it(gpt_oss):
    srv, _ = gpt_oss
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Need the tool.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=[WEATHER])
    text = srv.app[STATE].template.render(
        srv.engine.tokenizer, [m.for_template() for m in body.messages], body.tools, {})
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Paris"}<|call|>') in text  # the object, not a quoted string
    assert text.endswith('<|start|>functions.get_weather to=assistant<|channel|>commentary'
                         '<|message|>"sunny"<|end|><|start|>assistant')


STREAM = ("<|channel|>analysis<|message|>Think <|end|> twice.<|end|><|start|>assistant"
          "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant to=functions."
          'get_time<|channel|>commentary json<|message|>{"tz": "CET"}<|call|><|start|>assistant'
          '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
          '"Paris"}<|call|>')


def _joined(stream: HarmonyStream, pieces: list[str]) -> tuple[str, str, dict]:
    reasoning, content, calls = "", "", {}
    for part in [stream.feed(p) for p in pieces] + [stream.finish()]:
        reasoning, content = reasoning + part.reasoning, content + part.content
        for call in part.calls:
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name", "")
            entry[1] += call["function"]["arguments"]
    return reasoning, content, calls


def test_the_parser_finds_every_marker_wherever_the_tokens_cut_it():
    whole = _joined(HarmonyStream(tools=True), [STREAM])
    assert whole == ("Think ", "Let me check.", {0: ["get_time", '{"tz": "CET"}'],
                                                 1: ["get_weather", '{"city": "Paris"}']})
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(1, 12)))
        pieces = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)])]
        stream = HarmonyStream(tools=True)
        assert _joined(stream, pieces) == whole
        assert [c.name for c in stream.calls] == ["get_time", "get_weather"]
    single = HarmonyStream(tools=True, single=True)  # parallel_tool_calls false: the first
    assert _joined(single, [STREAM])[2] == {0: ["get_time", '{"tz": "CET"}']}
    assert [c.name for c in single.calls] == ["get_time"]
    # text that never becomes a header is content; an unfinished body keeps what it has
    assert _joined(HarmonyStream(tools=False), ["plain words"]) == ("", "plain words", {})
    assert _joined(HarmonyStream(tools=False), ["x" * 300, "y"]) == ("", "x" * 300 + "y", {})
    assert _joined(HarmonyStream(tools=False), ["<|channel|>final<|message|>cut <|e"]) == (
        "", "cut <|e", {})
    assert is_harmony(HARMONY_TEMPLATE) and not is_harmony("{{ messages }}")


def test_the_parsers_are_picked_together_or_refused():
    assert ChatTemplate(HARMONY_TEMPLATE, 1.0).tool_parser == "openai"
    none = ChatTemplate(HARMONY_TEMPLATE, 1.0, reasoning_parser="none")
    assert (none.reasoning_parser, none.tool_parser) == (None, "hermes")
    with pytest.raises(ValueError, match="go together"):
        ChatTemplate(HARMONY_TEMPLATE, 1.0, tool_parser="hermes")


def test_the_responses_and_messages_apis_read_the_channels(gpt_oss):
    srv, script = gpt_oss
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    tool = {"type": "function", "name": "get_weather",
            "parameters": WEATHER["function"]["parameters"]}
    script.say(ANALYSIS + CALL)
    out = client.responses.create(model=model, input="Weather in Paris?", tools=[tool])
    assert [item.type for item in out.output] == ["reasoning", "function_call"]
    assert out.output[0].content[0].text == "The user wants weather."
    assert json.loads(out.output[1].arguments) == {"city": "Paris"}
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    script.say(ANALYSIS + FINAL)
    message = claude.messages.create(model=model, max_tokens=100, messages=[
        {"role": "user", "content": "Weather in Paris?"}])
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in message.content] == [("thinking", "The user wants weather."),
                                          ("text", "It is sunny.")]


def test_a_gguf_file_ends_a_turn_at_return_and_at_call(tmp_path):
    """llama.cpp's converter writes <|return|> as EOS; a tool call's <|call|> ends the turn
    too (generation_config.json lists both; llama.cpp's vocab loader adds them by text)."""
    import gguf

    from tests.gguf_files import write_gguf
    from tritonserve.engine.models.gguf_convert import GGUFMeta, config_of, family_of_gguf
    model = write_tiny_model(tmp_path / "model", "GptOssForCausalLM", seed=5,
                             special=HARMONY_TOKENS)
    meta = GGUFMeta(gguf.GGUFReader(str(write_gguf(model, tmp_path / "m.gguf"))))
    family, architecture = family_of_gguf(meta.arch, True)
    tokens = meta.fields["tokenizer.ggml.tokens"]
    eos = config_of(meta, family, architecture)["eos_token_id"]
    assert set(eos) == {tokens.index("<|im_end|>"), tokens.index("<|return|>"),
                        tokens.index("<|call|>")}


def test_earlier_reasoning_from_every_api_reaches_the_template(gpt_oss):
    """A Responses reasoning item and an Anthropic thinking block before a call become the
    turn's reasoning_content, which gpt-oss's template keeps before the call (its analysis)."""
    from tritonserve.server.messages_input import MessagesRequest, _chat_messages
    from tritonserve.server.responses_input import ResponsesRequest, input_messages
    srv, _ = gpt_oss
    analysis = ("<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
                "<|start|>assistant to=functions.get_weather")
    responses = input_messages(ResponsesRequest(model="m", input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]))
    anthropic = _chat_messages(MessagesRequest(model="m", max_tokens=10, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": "x"},
            {"type": "tool_use", "id": "call_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}]}]))
    for messages in (responses, anthropic):
        body = ChatCompletionRequest(messages=messages, tools=[WEATHER])
        text = srv.app[STATE].template.render(
            srv.engine.tokenizer, [m.for_template() for m in body.messages], body.tools, {})
        assert analysis in text
