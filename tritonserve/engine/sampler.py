"""Batched sampling: logit bias, min_tokens, penalties, logprobs, then the sampling kernel.

Everything is one pass of tensor ops over the batch (rows with mixed parameters); the only
per-request Python work is building small per-row parameter lists. Per-request tensors (token
counts, bias and ban rows) persist across steps in SamplingState. The draw itself is one
registered op, `torch.ops.tritonserve.sample` (a fake implementation, so torch.compile traces
through it), whose `backend` argument picks `kernels.sample` (Triton) or
`kernels.reference.sample` (torch); both take the same arguments.
"""
from __future__ import annotations

import functools
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tritonserve.kernels import triton as kernels

from tritonserve.kernels import cpu, reference

from .outputs import TopLogprob
from .request import Request
from .sampling_state import SamplingState
from .structured import TokenBitmask

# the token of a row whose own rules (a grammar, a min_tokens ban over stop_token_ids) forbid
# every token: the engine ends that request alone (NoTokenAllowedError); an all -inf row
# would otherwise draw token 0 (argmax) or fail the batch's multinomial
NO_TOKEN = -1

_SEED_MASK = (1 << 62) - 1
_GOLDEN = 0x9E3779B97F4A7C15


_STEP = 0xBF58476D1CE4E5B9


def step_seed(request_seed: int, output_index: int) -> int:
    """A per-token seed that depends only on the request's seed and the token's index, so a
    seeded request samples the same tokens whatever else is in the batch."""
    return (request_seed * _GOLDEN + output_index * _STEP + 1) & _SEED_MASK


def _as_int64(value: int) -> int:
    """The int64 with the same low 64 bits (seeds go up to 2**64 - 1)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def step_seeds(request_seeds: torch.Tensor, output_indices: torch.Tensor) -> torch.Tensor:
    """step_seed for a batch: int64 [S] seeds (as _as_int64) and indices -> int64 [S]. int64
    products wrap mod 2**64, and the mask keeps 62 low bits, so this equals step_seed."""
    return (request_seeds * _as_int64(_GOLDEN) + output_indices * _as_int64(_STEP)
            + 1) & _SEED_MASK


@torch.library.custom_op("tritonserve::sample", mutates_args=())
def sample_op(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
              backend: str) -> torch.Tensor:
    """logits [B, V]; temperature, top_p, min_p float [B]; top_k int32 [B] (<= 0: off); seeds
    int64 [B] -> token ids int64 [B]; backend "triton" or "torch". An op call costs ~10 us
    more than the direct call, once a step."""
    sample = kernels.sample if backend == "triton" else reference.sample
    return sample(logits, temperature, top_k, top_p, min_p, seeds)


@sample_op.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds, backend):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def _filters_nothing(p) -> bool:
    """Greedy, or a draw from the whole softmax: no top-k, top-p or min-p."""
    return p.greedy or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0)


def _changes_logits(p) -> bool:
    """Bias, min_tokens, penalties or logprobs: work on the fp32 logits before the draw."""
    return bool(p.logit_bias or p.min_tokens or p.needs_penalties or p.logprobs is not None)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[TopLogprob, ...] | None


class Sampler:
    def __init__(self, draw: str, vocab_size: int, seed: int, max_model_len: int,
                 device: torch.device = torch.device("cpu")) -> None:
        """draw: the decode plan's (engine/plan.py): triton, cpu or torch."""
        # draw triton (CUDA): the kernel for the rows that filter nothing, the torch path for
        # rows with top-k / top-p / min-p. On an H200 at batch 128 x vocabulary 128,256 the
        # kernel drew plain rows in 0.30 ms against torch's 1.39, but its threshold bisection
        # (one program a row over the whole vocabulary) took 4.17 ms for top-p 0.95 and 7.86
        # for top-k 50 + top-p 0.9 against 2.51 / 1.94 (docs/benchmarks.md, "On a GPU"). By
        # a row's own parameters, so a seeded row draws the same token in any batch.
        self._sample = functools.partial(torch.ops.tritonserve.sample, backend="torch")
        # draw cpu, the rows that filter nothing (the server's default sampling): one C++
        # pass a row instead of softmax, max and chunk passes over [B, V] (the sampler phase
        # of a batch-64 SmolLM2 step 2.4 -> 0.6 ms). Chosen by a row's own parameters, so a
        # seeded row draws the same token in any batch.
        self._softmax_draw = cpu.op("sample_softmax") if draw == "cpu" else None
        self._plain_draw = self._triton_plain if draw == "triton" else self._softmax_draw
        self.vocab_size = vocab_size
        self._rng = torch.Generator().manual_seed(seed)
        self.state = SamplingState(vocab_size, max_model_len, device)
        self.bitmask = TokenBitmask(vocab_size)

    def release(self, request_id: str) -> None:
        """The request has ended: its per-request rows go back to the pools."""
        self.state.release(request_id)

    def start_masks(self, requests: list[Request]) -> Future | None:
        """Starts filling the grammar bitmasks of the rows that have one (call it before the
        forward, so the fills overlap it); pass the result to __call__."""
        if any(r.matcher is not None for r in requests):
            return self.bitmask.fill([r.matcher for r in requests])
        return None

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 masks: Future | None = None) -> list[SampledToken]:
        """logits [B, V] for the B requests that sample this step (in that order); the rows
        may be changed in place. masks: start_masks(requests), or None to fill them here."""
        device = logits.device
        params = [r.params for r in requests]
        if (self._softmax_draw is not None and masks is None
                and not any(_changes_logits(p) for p in params)
                and all(r.matcher is None for r in requests)):
            # nothing to apply before the draw: the model's logits as they are (bf16
            # included; the fp32 copy alone was 0.7 ms of a batch-64 step). Greedy rows are
            # the draw's first argmax, torch.argmax's rule: an all-greedy batch of 64 took
            # 1.6-2.1 ms through the fp32 copy and torch.argmax, 0.07 here
            # (docs/perf-log/2026-cpu-decode.md); it draws no seeds, so the engine's generator moves as before
            greedy = all(p.greedy for p in params)
            seeds = (torch.zeros(len(requests), dtype=torch.int64, device=logits.device) if greedy
                     else self._seeds(requests))
            token_ids = self._draw(logits, params, seeds)
            self.state.record(requests, token_ids)
            return self._outputs(token_ids, None, params)
        logits = logits.float()
        logprobs = None
        if any(p.logprobs is not None for p in params):
            # the model's raw distribution, before bias, min_tokens, penalties and temperature
            # (vLLM's default logprobs mode)
            logprobs = torch.log_softmax(logits, dim=-1)
        if any(p.logit_bias or p.min_tokens or p.needs_penalties for p in params):
            logits = self.state.apply(logits, requests)
        self.bitmask.apply(logits, masks if masks is not None else self.start_masks(requests))
        refused = self._refused_rows(logits, requests)
        if refused:
            logits[refused] = 0.0  # any draw will do: the rows' tokens become NO_TOKEN

        if all(p.greedy for p in params):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._draw(logits, params, self._seeds(requests).to(device))
        self.state.record(requests, token_ids)
        outputs = self._outputs(token_ids, logprobs, params)
        for row in refused:
            outputs[row] = SampledToken(NO_TOKEN, None, None)
        return outputs

    @staticmethod
    def _refused_rows(logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """Rows where nothing is left to draw: only a grammar or a min_tokens ban sets a
        logit to -inf, so only their rows are looked at."""
        rows = [row for row, r in enumerate(requests) if r.matcher is not None
                or r.num_output_tokens < r.params.min_tokens]
        if not rows:
            return []
        empty = torch.isneginf(logits[rows]).all(dim=-1).tolist()
        return [row for row, none_left in zip(rows, empty) if none_left]

    @staticmethod
    def _triton_plain(logits: torch.Tensor, temperature: torch.Tensor,
                      seeds: torch.Tensor) -> torch.Tensor:
        """The Triton kernel's draw from the whole softmax (no filter), the C++ draw's form."""
        rows, device = logits.shape[0], logits.device
        return torch.ops.tritonserve.sample(
            logits, temperature, torch.zeros(rows, dtype=torch.int32, device=device),
            torch.ones(rows, device=device), torch.zeros(rows, device=device), seeds,
            backend="triton")

    def _draw(self, logits: torch.Tensor, params: list, seeds: torch.Tensor) -> torch.Tensor:
        """logits [B, V] (fp32; bf16 too with the C++ draw) -> [B] tokens: the rows that
        filter nothing (greedy ones too: an argmax either way) through the plan's plain draw
        (C++ on the CPU, Triton on CUDA) when there is one, the rest through the torch op."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        plain = [_filters_nothing(p) for p in params]
        if self._plain_draw is not None and all(plain):
            return self._plain_draw(logits, temperature, seeds)
        if self._plain_draw is None or not any(plain):
            rows = slice(None)
        else:
            rows = torch.tensor([row for row, s in enumerate(plain) if not s], dtype=torch.int64,
                                device=device)
        tokens = self._sample(
            logits[rows], temperature[rows],
            torch.tensor([p.top_k for p in params], dtype=torch.int32, device=device)[rows],
            torch.tensor([p.top_p for p in params], device=device)[rows],
            torch.tensor([p.min_p for p in params], device=device)[rows], seeds[rows])
        if isinstance(rows, slice):
            return tokens
        simple = torch.tensor([row for row, s in enumerate(plain) if s], dtype=torch.int64,
                              device=device)
        out = torch.empty(len(params), dtype=torch.int64, device=device)
        out[rows] = tokens
        out[simple] = self._plain_draw(logits[simple], temperature[simple], seeds[simple])
        return out

    def _seeds(self, requests: list[Request]) -> torch.Tensor:
        """[B] int64: one draw from the engine's generator for the batch, then the per-token
        seed of every request that has its own."""
        seeds = torch.randint(0, 1 << 62, (len(requests),), generator=self._rng)
        own = [(row, _as_int64(r.params.seed), r.num_output_tokens)
               for row, r in enumerate(requests) if r.params.seed is not None]
        if own:
            rows, request_seeds, indices = zip(*own)
            seeds[list(rows)] = step_seeds(torch.tensor(request_seeds, dtype=torch.int64),
                                           torch.tensor(indices, dtype=torch.int64))
        return seeds

    @staticmethod
    def _outputs(token_ids: torch.Tensor, logprobs: torch.Tensor | None,
                 params) -> list[SampledToken]:
        ids = token_ids.tolist()
        if logprobs is None:
            return [SampledToken(t, None, None) for t in ids]
        max_n = max(p.logprobs or 0 for p in params)
        top_values, top_ids = (logprobs.topk(max_n, dim=-1) if max_n else (None, None))
        chosen = logprobs.gather(1, token_ids.view(-1, 1).to(logprobs.device)).squeeze(1).tolist()
        if max_n:
            top_ids, top_values = top_ids.tolist(), top_values.tolist()
        outputs = []
        for row, (token_id, p) in enumerate(zip(ids, params)):
            if p.logprobs is None:
                outputs.append(SampledToken(token_id, None, None))
                continue
            top = ()
            if p.logprobs:
                top = tuple(TopLogprob(i, v) for i, v in
                            zip(top_ids[row][:p.logprobs], top_values[row][:p.logprobs]))
            outputs.append(SampledToken(token_id, float(chosen[row]), top))
        return outputs
