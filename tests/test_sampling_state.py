"""SamplingState: the kept per-request tensors (counts, seen tokens, bias, min_tokens bans) give
the same logits as rebuilding them from each request's tokens every step, rows go back to the
pools when requests end, and the batched per-token seeds equal the scalar ones."""
from __future__ import annotations

import random

import torch

from tritonserve.engine import LLM, SamplingParams
from tritonserve.engine.request import Request
from tritonserve.engine.sampler import step_seed, step_seeds
from tritonserve.engine.sampling_state import RowPool, SamplingState, apply_penalties

VOCAB = 40
EOS = frozenset({0})


def make_request(name: str, prompt: list[int], params: SamplingParams) -> Request:
    return Request(request_id=name, prompt=None, prompt_token_ids=prompt, params=params,
                   arrival_time=0.0, eos_token_ids=EOS, detokenizer=None, stop_matcher=None)


def rebuilt(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """What the sampler computed before the pools: every tensor rebuilt, row by row."""
    logits = logits.clone()
    for row, r in enumerate(requests):
        p = r.params
        for token_id, value in p.logit_bias.items():
            logits[row, token_id] += value
        if r.num_output_tokens < p.min_tokens:
            logits[row, sorted(EOS | set(p.stop_token_ids))] = float("-inf")
        if p.needs_penalties:
            mask = torch.zeros(1, VOCAB, dtype=torch.bool)
            mask[0, r.prompt_token_ids] = True
            counts = torch.zeros(1, VOCAB)
            for t in r.output_token_ids:
                counts[0, t] += 1
            logits[row] = apply_penalties(
                logits[row:row + 1], mask, counts, torch.tensor([p.repetition_penalty]),
                torch.tensor([p.presence_penalty]), torch.tensor([p.frequency_penalty]))[0]
    return logits


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(5)
    if kind == 0:
        return SamplingParams()
    if kind == 1:
        return SamplingParams(repetition_penalty=rng.uniform(0.5, 2.0),
                              presence_penalty=rng.uniform(-1, 1),
                              frequency_penalty=rng.uniform(-1, 1))
    if kind == 2:
        return SamplingParams(logit_bias={rng.randrange(VOCAB): rng.uniform(-5, 5)
                                          for _ in range(3)})
    if kind == 3:
        return SamplingParams(min_tokens=rng.randrange(1, 5),
                              stop_token_ids=[rng.randrange(1, VOCAB)])
    return SamplingParams(min_tokens=2, frequency_penalty=0.5, logit_bias={3: 2.0})


def test_pooled_rows_match_rebuilt_tensors_over_many_steps():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    state = SamplingState(VOCAB, 64, torch.device("cpu"))
    live: list[Request] = []
    made = 0
    for _ in range(60):
        while len(live) < 6 and rng.random() < 0.7:  # requests come and go between steps
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
            request = make_request(f"r{made}", prompt, random_params(rng))
            if rng.random() < 0.3:  # resumed after a preemption: output tokens already there
                request.token_ids += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
            live.append(request)
            made += 1
        if not live:
            continue
        batch = rng.sample(live, len(live))  # the batch order changes from step to step
        logits = torch.randn(len(batch), VOCAB, generator=gen) * 3
        want = rebuilt(logits, batch)
        got = state.apply(logits.clone(), batch)
        torch.testing.assert_close(got, want)
        tokens = torch.randint(0, VOCAB, (len(batch),), generator=gen)
        state.record(batch, tokens)
        for r, t in zip(batch, tokens.tolist()):
            r.token_ids.append(t)
        for r in list(live):
            if rng.random() < 0.15:
                live.remove(r)
                state.release(r.request_id)
    for r in live:
        state.release(r.request_id)
    assert state.num_requests == 0
    pen = state.penalties
    for pool in (pen.counts, pen.in_prompt, pen.seen, pen.num_seen):
        assert pool.rows_in_use == 0
        assert not pool.tensor.any()  # released rows come back zeroed


def test_row_pool_grows_and_keeps_rows():
    pool = RowPool(5, torch.float32, torch.device("cpu"), capacity=2)
    rows = [pool.acquire() for _ in range(5)]
    assert sorted(rows) == list(range(5)) and pool.tensor.shape[0] >= 5
    pool.tensor[rows[0], 1] = 7.0
    pool.acquire()  # may grow again
    assert pool.tensor[rows[0], 1] == 7.0


def test_batched_step_seeds_equal_scalar_ones():
    rng = random.Random(1)
    seeds = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1] + [rng.randrange(1 << 64)
                                                             for _ in range(50)]
    indices = [rng.randrange(100_000) for _ in seeds]
    wrapped = [s - (1 << 64) if s >= 1 << 63 else s for s in seeds]
    got = step_seeds(torch.tensor(wrapped), torch.tensor(indices)).tolist()
    assert got == [step_seed(s, i) for s, i in zip(seeds, indices)]


def test_engine_returns_sampling_rows_when_requests_end(tiny_model):
    llm = LLM(tiny_model)
    params = [SamplingParams(max_tokens=6, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=3, logit_bias={5: 3.0}, min_tokens=2, ignore_eos=True),
              SamplingParams(max_tokens=4, frequency_penalty=0.4, temperature=0.0,
                             ignore_eos=True),
              SamplingParams(max_tokens=5, ignore_eos=True)]
    outs = llm.generate(["one", "two three", "four five six", "seven"], params)
    assert [len(o.token_ids) for o in outs] == [6, 3, 4, 5]
    state = llm.engine.runner.sampler.state
    assert state.num_requests == 0
    assert state.penalties.counts.rows_in_use == 0
