"""Per-request sampling parameters, validated with errors that name the parameter.

Each range is the one in which every step stays finite in float32 and every value fits the
tensor it is copied into, so a request that passes here can never fail a batch's step.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .config import POOLING_CHOICES
from .errors import InvalidRequestError
from .structured import StructuredOutput

MAX_LOGPROBS = 20
# Below this, logits / T overflows float32 (vLLM raises such temperatures to the same floor).
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
# Repetition penalty divides and multiplies logits: outside this range they reach 0 or inf.
PENALTY_RANGE = (1e-2, 100.0)
SEED_LIMIT = 1 << 64  # seeds are unsigned 64-bit


def _fail(name: str, rule: str, value: object) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    raise InvalidRequestError(name, f"{name} must be {rule}, got {shown}")


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(name, "a finite number", value)
    return float(value)


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, "an integer", value)
    return value


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy; (0, 0.01) is raised to 0.01
    top_k: int = -1  # -1 or 0 = off; at or above the vocabulary size = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; >1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop token ids are suppressed until this many tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per output token, 0 = sampled token only
    # each prompt token's logprob and top-N alternatives (vLLM's field; completions' echo with
    # logprobs): the prompt is computed in full, never served from the prefix cache
    prompt_logprobs: int | None = None
    # an embedding request (engine/pooling.py's KINDS: last, mean, cls): with max_tokens 0,
    # the request ends once its prompt is computed, carrying the pooled hidden state
    pooling: str | None = None
    # the scheduler's order (vLLM's meaning): lower runs first and preempts higher under a
    # full cache (engine/scheduler.py); equal priorities are first come, first served
    priority: int = 0
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # a grammar the output must follow
    # the grammar starts after this text appears in the output (a reasoning model's
    # end-of-thinking tag, engine/reasoning_end.py, as vLLM applies structured output after
    # the reasoning); "" = at once
    structured_after: str = ""

    def __post_init__(self) -> None:
        temperature = _check_number("temperature", self.temperature)
        if not 0 <= temperature <= MAX_TEMPERATURE:
            _fail("temperature", f"in [0, {MAX_TEMPERATURE:g}] (0 means greedy)",
                  self.temperature)
        if 0 < temperature < MIN_TEMPERATURE:
            temperature = MIN_TEMPERATURE
        # stored as floats: an int (temperature=0) reached the sampler's tensors as int64,
        # which the C++ draw refuses
        object.__setattr__(self, "temperature", temperature)
        if _check_int("top_k", self.top_k) < -1:
            _fail("top_k", "-1 (off), 0 (off) or a positive integer", self.top_k)
        top_p = _check_number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            _fail("top_p", "in (0, 1]", self.top_p)
        if not 0.0 <= _check_number("min_p", self.min_p) <= 1.0:
            _fail("min_p", "in [0, 1]", self.min_p)
        low, high = PENALTY_RANGE
        if not low <= _check_number("repetition_penalty", self.repetition_penalty) <= high:
            _fail("repetition_penalty", f"in [{low:g}, {high:g}]", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _check_number(name, getattr(self, name)) <= 2.0:
                _fail(name, "in [-2, 2]", getattr(self, name))
        for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.seed is not None and not 0 <= _check_int("seed", self.seed) < SEED_LIMIT:
            _fail("seed", "an integer in [0, 2**64)", self.seed)
        if not -(1 << 31) <= _check_int("priority", self.priority) < 1 << 31:
            _fail("priority", "a 32-bit integer", self.priority)
        if self.pooling is not None and self.pooling not in POOLING_CHOICES[1:]:
            _fail("pooling", "last, mean or cls", self.pooling)
        if self.prompt_logprobs is not None:
            if not 0 <= _check_int("prompt_logprobs", self.prompt_logprobs) <= MAX_LOGPROBS:
                _fail("prompt_logprobs", f"in [0, {MAX_LOGPROBS}]", self.prompt_logprobs)
        if _check_int("max_tokens", self.max_tokens) < (0 if self.prompt_only else 1):
            _fail("max_tokens", ">= 1 (0 only to score or embed a prompt: with "
                  "prompt_logprobs or pooling)",
                  self.max_tokens)
        if _check_int("min_tokens", self.min_tokens) < 0 or self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            _fail("stop", "a list of non-empty strings", self.stop)
        object.__setattr__(self, "stop", stop)
        stop_ids = tuple(self.stop_token_ids or ())
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop_ids):
            _fail("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if self.logprobs is not None:
            if not 0 <= _check_int("logprobs", self.logprobs) <= MAX_LOGPROBS:
                _fail("logprobs", f"in [0, {MAX_LOGPROBS}]", self.logprobs)
        bias = {}
        for token, value in dict(self.logit_bias or {}).items():
            token_id = int(token) if isinstance(token, str) and token.isdigit() else token
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                _fail("logit_bias", "a map of token ids to biases", self.logit_bias)
            if not -100.0 <= _check_number("logit_bias", value) <= 100.0:
                _fail("logit_bias", "a map of token ids to biases in [-100, 100]", self.logit_bias)
            bias[token_id] = float(value)
        object.__setattr__(self, "logit_bias", bias)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            _fail("structured", "a StructuredOutput", self.structured)
        if not isinstance(self.structured_after, str) or len(self.structured_after) > 64:
            _fail("structured_after", "a string of at most 64 characters",
                  self.structured_after)

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0 is allowed: the request ends once its prompt is computed, scored
        (lm-eval's loglikelihood requests) or embedded."""
        return self.prompt_logprobs is not None or self.pooling is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def for_vocab(self, vocab_size: int) -> SamplingParams:
        """These parameters checked against the model's vocabulary (token ids can only be
        checked once the model is known), with a top_k that covers it switched off."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", tuple(self.logit_bias))):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                _fail(name, f"token ids below the vocabulary size {vocab_size}", bad[:8])
        if self.top_k >= vocab_size:
            return dataclasses.replace(self, top_k=-1)
        return self
