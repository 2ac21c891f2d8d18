"""Continuous batching under a per-step token budget, vLLM-v1 style.

There are no separate prefill and decode phases: every running request asks for the tokens it
has not computed yet (a whole prompt, a chunk of it, or the one token sampled last step), and
the scheduler hands out the budget first to running requests, then to waiting ones in arrival
order. While another request decodes, a prompt longer than long_prefill_tokens computes at
most that many tokens a step (each chunk is a step the streams beside it wait for). Requests
that compute only their prompt (embeddings, scoring) take at most
max_prompt_only_tokens of a step while another request decodes, and at most prompt_only_share
of the engine's time: a step with their tokens comes once the decode steps since the last one
have earned its time (account(), called after every step). A failed block allocation is
the single back-pressure signal: it preempts the most recently arrived running request (its
blocks are freed and it is recomputed later). The choices of an n > 1 request wait until their
first sibling has computed the shared prompt, then take its full blocks from the prefix cache:
the prompt is prefilled once.

With speculative decoding (engine/speculative.py) a decoding request may also carry up to K
proposed tokens: it asks for 1 + K tokens of budget and KV slots, and the engine keeps the
slots of the accepted ones only. A step proposes only while at most max_batch requests run.

Priority (SamplingParams.priority, vLLM's meaning: lower runs first; 0 by default): the waiting
queue is ordered by (priority, arrival); back-pressure preempts the lowest-priority running
request (the most recently admitted among equals, as without priorities); a waiting request
that finds no room (the cache full, or max_num_seqs running) preempts running requests of
strictly lower priority until it fits; and the step that admits it leaves those requests out
(they lose one step), so its first token is not behind their decode rows: beside 64 streams of
SmolLM2 on 2 cores that step took 150 ms with them and 37 ms without (docs/benchmarks.md,
"Priority"). Equal priorities behave exactly as FCFS. What is left is the step in flight when
it arrives: for priority_window_s after a request of priority p arrives, a step computes at most
priority_step_tokens tokens of worse priority (running requests least recently run first, the
rest to waiting ones), so the next such request waits for a short step (on the CPU a step's
time grows with its rows). The rules are engine/priority.py's.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .config import SchedulerConfig
from .kv_cache import KVCacheManager
from .priority import UrgentWindow, key, victim
from .request import Request, RequestStatus
from .speculative import NgramProposer, eligible, worth_proposing


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (== num_computed_tokens at schedule time)
    num_new_tokens: int  # the proposals included
    proposals: tuple[int, ...] = ()  # speculated tokens after the last one, to verify

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, so its logits
        give the next token; False for a chunk in the middle of a prompt."""
        return self.start + self.num_new_tokens - len(self.proposals) == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[str]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 proposer: NgramProposer | None = None, speculate_below: int = 0,
                 max_model_len: int = 0, max_rows: int = 1 << 30,
                 min_acceptance: float = 0.0, priority_step_tokens: int | None = None,
                 long_prefill_tokens: int | None = None) -> None:
        self.config = config
        # SchedulerConfig.long_prefill_tokens on this device (None: no cap)
        self.long_prefill_tokens = long_prefill_tokens
        self.kv_cache = kv_cache
        self.proposer = proposer
        self.speculate_below = speculate_below  # at most this many running requests
        self.max_model_len = max_model_len
        # decode rows a speculating step may reach: a step past the plan's dense_above would
        # run other weights (engine/plan.py) than the same step without proposals
        self.max_rows = max_rows
        self.min_acceptance = min_acceptance
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prioritized = False  # a request with a priority other than 0 has come
        self.step_count = 0
        self.urgent = UrgentWindow(priority_step_tokens, config.priority_window_s)
        # prompt_only_share: seconds of prompt-only work earned (< 0: owed) while one decodes
        self._prompt_only_credit = 0.0
        self._num_prompt_only = 0  # unfinished requests with max_tokens 0
        self._decoding: bool | None = None  # this step's: some request decodes

    @property
    def priority_step_tokens(self) -> int | None:
        return self.urgent.step_tokens

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        priority = request.params.priority
        if priority:
            self.prioritized = True  # from now on the priority checks run (cheap otherwise)
        if request.params.max_tokens == 0:
            self._num_prompt_only += 1
        if self.prioritized:
            self.urgent.arrived(priority)
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        """Into the waiting queue by (priority, arrival): behind every request it does not
        precede (O(1) for the usual arrival in order)."""
        order = key(request)
        at = len(self.waiting)
        while at > 0 and order < key(self.waiting[at - 1]):
            at -= 1
        self.waiting.insert(at, request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out and return its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        if request.params.max_tokens == 0 and request.status is not RequestStatus.FINISHED:
            self._num_prompt_only -= 1
        request.status = RequestStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._prompt_only_left: int | None = None  # set at the first prompt-only request
        self._decoding: bool | None = None  # _someone_decodes, decided at its first call

        speculate = self.proposer is not None and len(self.running) <= self.speculate_below
        room = self.max_rows - len(self.running)  # proposals this step may add
        head = self.waiting[0] if self.waiting and self.prioritized else None
        outranked_by = head.params.priority if head is not None \
            and not head.waits_for_sibling else None  # running requests it outranks wait
        self.step_count += 1
        capped = self.urgent.allowance(self.running)
        # the LoRA adapters running requests hold: at most max_loras (admission keeps it so)
        adapters = {r.lora.name for r in self.running if r.lora is not None}
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if outranked_by is not None and request.params.priority > outranked_by:
                index += 1  # a step off: the waiting request that outranks it goes first
                continue
            num_new = self._share(request, min(
                request.num_tokens - request.num_computed_tokens, budget))
            if capped is not None and request.params.priority > capped[0]:
                num_new = min(num_new, capped[1].get(request, 0))  # priority_step_tokens
            if num_new == 0:  # past its share this step (prompt-only, priority_step_tokens)
                index += 1
                continue
            proposals: tuple[int, ...] = ()
            if speculate and num_new == 1 and eligible(request) \
                    and worth_proposing(request, self.min_acceptance):
                proposals = tuple(self.proposer.propose(request.token_ids, min(
                    budget - 1, room, request.params.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens - 1)))
                num_new += len(proposals)
                room -= len(proposals)
                if proposals and not self.kv_cache.allocate(request, num_new):
                    proposals, num_new = (), 1  # no room for them: decode as usual
                elif proposals:
                    scheduled.append(ScheduledRequest(request, request.num_computed_tokens,
                                                      num_new, proposals))
                    budget -= num_new
                    index += 1
                    continue
            while not self.kv_cache.allocate(request, num_new):
                lost = self.running.pop(victim(self.running, index))
                self._preempt(lost)
                preempted.append(lost.request_id)
                if lost is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
                budget -= num_new
                index += 1

        # the running requests did not fit: admit none, unless the head outranks one of them
        pressure = bool(preempted)
        reading = 0  # requests at the head whose prefix is being read from disk: passed by
        while len(self.waiting) > reading and budget > 0:
            request = self.waiting[reading]
            if request.waits_for_sibling:  # FIFO: the queue behind it waits one step too
                break
            outranks = self.prioritized and any(
                r.params.priority > request.params.priority for r in self.running)
            worse = capped is not None and request.params.priority > capped[0]
            if worse and capped[2] == 0:
                break  # priority_step_tokens spent: the queue behind waits too
            if pressure and not outranks:
                break
            if request.lora is not None and request.lora.name not in adapters:
                if len(adapters) >= self.config.max_loras:
                    reading += 1  # max_loras held: it waits, the ones behind it go first
                    continue
                adapters.add(request.lora.name)
            fits = False
            if len(self.running) < self.config.max_num_seqs:
                if not self.kv_cache.read_from_disk(request):
                    reading += 1  # the ones behind it go first meanwhile
                    continue
                cached = self.kv_cache.find_cached_prefix(request)
                num_cached_tokens = len(cached) * self.kv_cache.block_size
                num_new = self._share(request, min(request.num_tokens - num_cached_tokens,
                                                   budget))
                if worse:
                    num_new = min(num_new, capped[2])
                if num_new == 0:  # the prompt-only share is spent: the queue waits a step
                    break
                fits = self.kv_cache.allocate(request, num_new, cached)
            if not fits:
                if not outranks:
                    break
                budget += self._make_room(request, scheduled, preempted)
                continue
            del self.waiting[reading]
            request.num_computed_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.perf_counter()
                request.cached_prompt_tokens = min(num_cached_tokens, request.num_prompt_tokens)
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_cached_tokens, num_new))
            budget -= num_new
            if worse:
                capped = (capped[0], capped[1], capped[2] - num_new)

        for entry in scheduled:
            entry.request.last_step = self.step_count
        return SchedulerOutput(scheduled, preempted)

    def _share(self, request: Request, num_new: int) -> int:
        """num_new, or less while some other request decodes: a prompt longer than
        long_prefill_tokens computes at most that many tokens a step (each chunk of a long
        prompt is a step the streams beside it wait for); a request that computes only its
        prompt (max_tokens 0: an embedding, a scoring) what is left of max_prompt_only_tokens
        this step, or none until prompt_only_share has earned it."""
        if request.params.max_tokens:
            cap = self.long_prefill_tokens
            if cap is not None and request.num_prompt_tokens > cap and num_new > cap \
                    and self._someone_decodes():
                return cap
            return num_new
        if self._prompt_only_left is None:
            self._prompt_only_left = (
                self.config.max_num_batched_tokens if not self._someone_decodes()
                else 0 if self._prompt_only_credit < 0  # prompt_only_share: not yet earned
                else self.config.max_prompt_only_tokens)
        num_new = min(num_new, self._prompt_only_left)
        self._prompt_only_left -= num_new
        return num_new

    def _someone_decodes(self) -> bool:
        """Whether a running request has its prompt computed and samples (this step's,
        decided once)."""
        if self._decoding is None:
            self._decoding = any(r.params.max_tokens and r.num_computed_tokens
                                 >= r.num_prompt_tokens for r in self.running)
        return self._decoding

    def account(self, schedule: SchedulerOutput, seconds: float) -> None:
        """After a step that took `seconds` (engine/llm_engine.py): prompt_only_share's
        books. While prompt-only requests wait beside decoding ones, a step without their
        tokens earns them share / (1 - share) of its time, a step with them spends its own."""
        share = self.config.prompt_only_share
        if share >= 1.0:
            return
        if not self._num_prompt_only:
            self._prompt_only_credit = 0.0
            return
        if any(s.request.params.max_tokens == 0 for s in schedule.scheduled):
            self._prompt_only_credit = (self._prompt_only_credit - seconds
                                        if self._decoding else 0.0)  # None: not asked
        else:
            self._prompt_only_credit += seconds * share / (1.0 - share)

    def _make_room(self, request: Request, scheduled: list[ScheduledRequest],
                   preempted: list[str]) -> int:
        """Preempts the lowest-priority running request for `request`, which outranks it;
        returns the budget the victim had taken this step (its entry is dropped)."""
        lost = self.running[victim(self.running, 0)]
        self.running.remove(lost)
        returned = 0
        for entry in [e for e in scheduled if e.request is lost]:
            scheduled.remove(entry)
            returned += entry.num_new_tokens
        self._preempt(lost)
        preempted.append(lost.request_id)
        return returned

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)

