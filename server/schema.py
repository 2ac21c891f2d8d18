"""Wire schemas (pydantic v2). docs/protocol.md is the normative description.

Native streaming protocol: every SSE payload is one of three events, discriminated on `type`:
`token` (one per sampled non-EOS token, zero-based contiguous `index`, `text` may be ""),
then exactly one terminal event, `done` or `error`.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from engine.sampling_params import MAX_LOGPROBS


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


class StreamErrorEvent(Strict):
    type: Literal["error"] = "error"
    code: str
    message: str


StreamEvent = Annotated[Union[StreamTokenEvent, StreamDoneEvent, StreamErrorEvent],
                        Field(discriminator="type")]
STREAM_EVENT = TypeAdapter(StreamEvent)


# ---- request bodies -----------------------------------------------------------------------
class SamplingFields(Strict):
    """Sampling parameters shared by every route (ranges as in engine.SamplingParams)."""

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(-1, ge=-1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True


class GenerateRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    stream: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[int] | list[str] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    n: int = Field(1, ge=1, le=1)
    echo: Literal[False] = False
    user: str | None = None


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1)
    user: str | None = None
