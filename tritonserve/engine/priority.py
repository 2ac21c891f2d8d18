"""The priority rules engine/scheduler.py applies (SamplingParams.priority, vLLM's meaning:
lower runs first): the waiting queue's order, the preemption victim, and the urgent window
that caps the tokens of worse priority a step computes (SchedulerConfig.priority_step_tokens;
why and the figures: engine/config.py, docs/benchmarks.md "Priority under a full cache").
"""
from __future__ import annotations

import time

from .request import Request


def key(request: Request) -> tuple[int, float]:
    """The waiting queue's order: (priority, arrival)."""
    return request.params.priority, request.arrival_time


def victim(running: list[Request], start: int) -> int:
    """The index, from `start` on, of the request to preempt: the lowest priority (the largest
    value), the latest among equals (the last one: FCFS's choice)."""
    return max(range(start, len(running)), key=lambda i: (running[i].params.priority, i))


class UrgentWindow:
    """For window_s after a request of priority p arrives, a step computes at most step_tokens
    tokens of worse priority (None: no cap): running requests first, least recently run
    first (Request.last_step), what is left to waiting ones."""

    def __init__(self, step_tokens: int | None, window_s: float) -> None:
        self.step_tokens = step_tokens
        self.window_s = window_s
        self._urgent: tuple[int, float] | None = None  # (p, until)

    def arrived(self, priority: int) -> None:
        now = time.perf_counter()
        if self._urgent is None or priority <= self._urgent[0] or now > self._urgent[1]:
            self._urgent = (priority, now + self.window_s)

    def allowance(self, running: list[Request]) -> tuple[int, dict[Request, int], int] | None:
        """None (no cap this step), or (p, the tokens each running request of worse priority
        may compute, the tokens left for waiting ones of worse priority)."""
        if self._urgent is None or self.step_tokens is None:
            return None
        priority, until = self._urgent
        if time.perf_counter() > until:
            self._urgent = None
            return None
        worse = sorted((r for r in running if r.params.priority > priority),
                       key=lambda r: r.last_step)  # stable: the earlier admitted among equals
        left, allowed = self.step_tokens, {}
        for request in worse:
            if left == 0:
                break
            allowed[request] = min(left, request.num_tokens - request.num_computed_tokens)
            left -= allowed[request]
        return priority, allowed, left
