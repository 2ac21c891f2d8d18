"""Wire schemas (pydantic v2). docs/protocol.md is the normative description.

Native streaming protocol: every SSE payload is one of three events, discriminated on `type`:
`token` (one per sampled non-EOS token, zero-based contiguous `index`, `text` may be ""),
then exactly one terminal event, `done` or `error`.
"""
from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter



class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- native stream events -----------------------------------------------------------------
class TopLogprobModel(Strict):
    token_id: int
    logprob: float


class TokenLogprobs(Strict):
    logprob: float
    top: list[TopLogprobModel]


class StreamTokenEvent(Strict):
    type: Literal["token"] = "token"
    index: int = Field(ge=0)
    text: str
    token_id: int = Field(ge=0)
    logprobs: TokenLogprobs | None = None


class StreamDoneEvent(Strict):
    type: Literal["done"] = "done"
    finish_reason: Literal["eos", "stop", "length"]
    prompt_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    text: str = Field(description="text held back until the end (a partial stop string or "
                                  "incomplete UTF-8 at EOS); usually empty")
    ttft_ms: float
    total_ms: float
    queue_wait_ms: float
    execution_ms: float
    tokens_per_s: float
    # the request's id (the caller's X-Request-Id, else generated), as the response header
    request_id: str | None = None


class StreamErrorEvent(Strict):
    type: Literal["error"] = "error"
    code: str
    message: str


StreamEvent = Annotated[Union[StreamTokenEvent, StreamDoneEvent, StreamErrorEvent],
                        Field(discriminator="type")]
STREAM_EVENT = TypeAdapter(StreamEvent)


# ---- request bodies -----------------------------------------------------------------------
class SamplingFields(Strict):
    """Sampling parameters shared by every route, by their engine.SamplingParams names. Types
    only: None means "the engine's default", and every range is SamplingParams' own (its
    error names the field), so no default or range is written here a second time."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top-N
    priority: int | None = None  # vLLM's: lower runs first (engine/scheduler.py)


class GenerateRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    stream: bool = False
    logprobs: int | None = None


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


MAX_CHOICES = 64  # n x prompts per request: each choice is an engine request


class OpenAIFields(SamplingFields):
    """Fields both OpenAI routes take. Those in routes_openai.UNSUPPORTED are documented by
    OpenAI but not served yet: a request that sets one gets a 400 naming it."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    response_format: dict | None = None
    # vLLM's extensions for structured output (server/structured.py)
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    # SGLang's, as sglang-router sends them (routes_openai.ROUTER_DEFAULTS)
    no_stop_trim: bool | None = None
    return_hidden_states: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None


class CompletionRequest(OpenAIFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    # an earlier turn's reasoning, as vLLM takes it back (Qwen3's templates read
    # reasoning_content; gpt-oss's reads thinking)
    reasoning_content: str | None = None
    reasoning: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates expect it: content parts joined into one string; an
        earlier turn's reasoning under the names templates read; a tool call's arguments as an
        object (OpenAI sends a JSON string; templates write `arguments | tojson`, which would
        quote the string again), as vLLM passes them."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None:
            message.pop("reasoning", None)
            message["reasoning_content"] = message["thinking"] = thinking
        if self.tool_calls:
            message["tool_calls"] = [_arguments_parsed(call) for call in self.tool_calls]
        return message


def _arguments_parsed(call: dict) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call  # not JSON: the template gets the text as sent
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**function, "arguments": parsed}}


class ChatCompletionRequest(OpenAIFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    modalities: list[str] | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None  # to templates that read it (server/chat_template.py)
    web_search_options: dict | None = None
    chat_template_kwargs: dict | None = None  # variables for the template (enable_thinking)
    chat_template: str | None = None  # refused: a template is server configuration
    # SGLang's and vLLM's, as their routers send them (routes_openai.ROUTER_DEFAULTS)
    continue_final_message: bool | None = None
    include_reasoning: bool | None = None


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
