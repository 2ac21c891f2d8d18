"""Which data-parallel engine serves a request (server/dp_engine.py asks; nothing else does).

Policies (`--data-parallel-routing`):
- "prefix" (default), SGLang's cache-aware routing, on the engines' own word for what they
  hold: each engine reports the digests entering and leaving its prefix cache
  (KVCacheManager.journal), and a prompt routed to an engine counts as held there until its
  prefill reports (so a burst of one prefix stays together). A prompt goes to the live engine
  holding the longest run of its leading block digests (engine/kv_cache.prompt_digests), ties
  to the fewest outstanding tokens, unless that engine's load passes BALANCE_REL x the least
  loaded engine's + BALANCE_TOKENS: then, as when no engine holds a block, to the least loaded.
- "least-tokens": the live engine with the fewest outstanding tokens.
- "random": a seeded uniform choice among live engines (the baseline of the hit-rate figure).

A request's outstanding tokens: its prompt tokens the chosen engine does not hold, plus its
max_tokens, less the tokens it has streamed. An engine that died is out of rotation for good.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from tritonserve.engine.kv_cache import prompt_digests

POLICIES = ("prefix", "least-tokens", "random")
BALANCE_TOKENS = 4096  # SGLang's balance_abs_threshold is 64 requests; ~32 of 128 tokens here
BALANCE_REL = 1.5  # SGLang's balance_rel_threshold


class NoEngineError(RuntimeError):
    """Every engine has died."""


@dataclass
class EngineLoad:
    """What the router knows of one engine."""

    held: set[bytes] = field(default_factory=set)  # digests its prefix cache reported
    pending: Counter = field(default_factory=Counter)  # digests of prompts not yet prefilled
    load: int = 0  # outstanding tokens
    requests: int = 0  # in flight
    routed: int = 0  # since start
    alive: bool = True

    def holds(self, digest: bytes) -> bool:
        return digest in self.held or digest in self.pending


@dataclass
class _Routed:
    engine: int
    remaining: int  # outstanding tokens
    pending: list[bytes]  # digests counted in the engine's pending until the first step


class Router:
    def __init__(self, num_engines: int, block_size: int, policy: str = "prefix",
                 seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"data_parallel_routing must be one of {POLICIES}, got {policy!r}")
        self.engines = [EngineLoad() for _ in range(num_engines)]
        self.block_size = block_size
        self.policy = policy
        self._rng = random.Random(seed)
        self._routed: dict[str, _Routed] = {}

    # ---- choosing ------------------------------------------------------------------------
    def route(self, request_id: str, prompt_ids: list[int], max_tokens: int,
              follow: str | None = None) -> int:
        """The engine for this request, recorded as its owner. `follow`: a request already
        routed whose engine this one must share (n > 1 choices wait for its prefill)."""
        digests = prompt_digests(prompt_ids, self.block_size) if self.policy == "prefix" else []
        if follow is not None and follow in self._routed:
            index = self._routed[follow].engine
        else:
            index = self._choose(digests)
        engine = self.engines[index]
        held = self._held_run(engine, digests)
        cost = len(prompt_ids) - held * self.block_size + max_tokens
        pending = digests[held:]
        engine.pending.update(pending)
        engine.load += cost
        engine.requests += 1
        engine.routed += 1
        self._routed[request_id] = _Routed(index, cost, pending)
        return index

    def _choose(self, digests: list[bytes]) -> int:
        live = [i for i, e in enumerate(self.engines) if e.alive]
        if not live:
            raise NoEngineError("every data-parallel engine has died")
        if self.policy == "random":
            return self._rng.choice(live)
        least = min(live, key=lambda i: (self.engines[i].load, i))
        if self.policy == "least-tokens" or not digests:
            return least
        best = max(live, key=lambda i: (self._held_run(self.engines[i], digests),
                                        -self.engines[i].load, -i))
        if self._held_run(self.engines[best], digests) == 0:
            return least
        if self.engines[best].load > BALANCE_REL * self.engines[least].load + BALANCE_TOKENS:
            return least
        return best

    @staticmethod
    def _held_run(engine: EngineLoad, digests: list[bytes]) -> int:
        """How many leading blocks of the prompt the engine holds."""
        run = 0
        for digest in digests:
            if not engine.holds(digest):
                break
            run += 1
        return run

    # ---- what the engines report ---------------------------------------------------------
    def owner(self, request_id: str) -> int | None:
        routed = self._routed.get(request_id)
        return None if routed is None else routed.engine

    def stepped(self, request_id: str, streamed: int, finished: bool) -> None:
        """A step of the request came back: `streamed` more tokens, and maybe its end."""
        routed = self._routed.get(request_id)
        if routed is None:
            return
        engine = self.engines[routed.engine]
        self._settle(engine, routed)
        if finished:
            self.forget(request_id)
            return
        taken = min(streamed, routed.remaining)
        routed.remaining -= taken
        engine.load -= taken

    def forget(self, request_id: str) -> None:
        """The request ended (finished, aborted, rejected, failed)."""
        routed = self._routed.pop(request_id, None)
        if routed is None:
            return
        engine = self.engines[routed.engine]
        self._settle(engine, routed)
        engine.load -= routed.remaining
        engine.requests -= 1

    @staticmethod
    def _settle(engine: EngineLoad, routed: _Routed) -> None:
        """Its prefill has reported (or it ended): the journal speaks for its blocks now."""
        if routed.pending:
            engine.pending.subtract(routed.pending)
            engine.pending += Counter()  # drops the zero counts
            routed.pending = []

    def journal(self, index: int, changes: list[tuple[bool, bytes]]) -> None:
        held = self.engines[index].held
        for added, digest in changes:
            if added:
                held.add(digest)
            else:
                held.discard(digest)

    def engine_died(self, index: int) -> list[str]:
        """Out of rotation for good; returns the ids of the requests it owned."""
        engine = self.engines[index]
        engine.alive = False
        owned = [rid for rid, r in self._routed.items() if r.engine == index]
        for request_id in owned:
            self.forget(request_id)
        engine.held.clear()
        engine.pending.clear()
        return owned

    @property
    def num_alive(self) -> int:
        return sum(e.alive for e in self.engines)
