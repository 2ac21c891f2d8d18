"""Per-request state owned by the engine (never crosses a boundary)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    # prompt + sampled tokens; the last sampled token's KV is computed in the next step
    token_ids: list[int] = field(init=False)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading full blocks already registered in the prefix cache
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache held at the first schedule
    block_hashes: list[bytes] = field(default_factory=list)  # sha256 chain, kv_cache.py
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    last_step: int = 0  # the scheduler's step count when it last ran (engine/scheduler.py)
    prefill_after: Request | None = None  # a sibling whose prompt prefill this one waits for
    matcher: object | None = None  # xgrammar GrammarMatcher of a structured request
    held_matcher: object | None = None  # the matcher until params.structured_after appears
    reasoning_end: object | None = None  # its engine/reasoning_end.py TagFinder, meanwhile
    # engine/speculative.py: a running mean of the share of its proposals accepted
    spec_acceptance: float = 1.0
    # SamplingParams.prompt_logprobs: the entries of prompt tokens 1.. computed so far (the
    # runner appends them; a recompute after preemption skips those), and whether they left
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # SamplingParams.pooling: the sum of the pooled rows' hidden states so far, and their
    # count (engine/pooling.py)
    pooled: object | None = None
    pooled_rows: int = 0
    lora: object | None = None  # its engine/lora.py LoraAdapter; None: the base model

    @property
    def waits_for_sibling(self) -> bool:
        """True while the sibling it shares a prompt with has not computed that prompt."""
        sibling = self.prefill_after
        return (sibling is not None and sibling.status is not RequestStatus.FINISHED
                and sibling.num_computed_tokens < sibling.num_prompt_tokens)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens
