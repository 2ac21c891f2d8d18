"""Messages that leave the engine: one GenerationStep per request per step."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(str, enum.Enum):
    EOS = "eos"  # the model sampled an end-of-sequence token (never counted, never sent)
    STOP = "stop"  # a stop string or stop token id matched
    LENGTH = "length"  # max_tokens (or max_model_len) reached: the last token is a real token
    ABORT = "abort"  # the caller aborted the request
    ERROR = "error"  # the engine failed on this request; Completion.error says how


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenOutput:
    """One sampled non-EOS token. `text` is the delta it releases and may be ""."""

    token_id: int
    index: int  # zero-based, contiguous within a request
    text: str
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] | None = None


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's log-probability under the model given the tokens before it (the
    prompt's first token has none), its rank among the vocabulary (1 = the most likely) and
    the top-N alternatives (SamplingParams.prompt_logprobs)."""

    token_id: int
    logprob: float
    rank: int
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class RequestTiming:
    """time.perf_counter() stamps; first_token is the finish time when no token came."""

    arrival: float
    first_scheduled: float
    first_token: float
    finish: float

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.arrival

    @property
    def total_s(self) -> float:
        return self.finish - self.arrival

    @property
    def queue_wait_s(self) -> float:
        return self.first_scheduled - self.arrival

    @property
    def execution_s(self) -> float:
        return self.finish - self.first_scheduled


@dataclass(frozen=True)
class Completion:
    """Why and how a request ended. `tail_text` is text held back until the end (a partial
    stop-string match, or incomplete UTF-8 when EOS arrived) that no token event carried."""

    reason: FinishReason
    prompt_tokens: int
    output_tokens: int
    timing: RequestTiming
    tail_text: str = ""
    matched_stop: str | int | None = None
    error: str | None = None  # set when reason is ERROR
    cached_tokens: int = 0  # prompt tokens the prefix cache served (OpenAI's usage reports it)


@dataclass(frozen=True)
class GenerationStep:
    """What happened to one request in one engine step.

    token only: a token was sampled and the request goes on.
    token and completion: the token was the last one (length, or a stop string it completed).
    completion only: the request ended without a token (EOS, stop token id, abort, error).
    """

    request_id: str
    token: TokenOutput | None
    completion: Completion | None
    # SamplingParams.prompt_logprobs: on the request's first step after its prompt is
    # computed, one entry per prompt token (None for the first)
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None
    # SamplingParams.pooling: on the request's last step, its pooled hidden state
    # (engine/pooling.py; not yet normalised)
    embedding: tuple[float, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.completion is not None


@dataclass(frozen=True)
class RequestOutput:
    """The whole result of one request, as the offline LLM API returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenOutput] | None
    timing: RequestTiming
    error: str | None = None  # why, when finish_reason is ERROR
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None
    embedding: tuple[float, ...] | None = None  # pooled, not normalised (LLM.embed does it)
