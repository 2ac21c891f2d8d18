"""Batched sampling: logit bias, min_tokens, penalties, logprobs, then the sampling kernel.

Everything is one pass of tensor ops over the batch (rows with mixed parameters); the only
per-request Python work is building small per-row parameter lists. The draw itself goes
through one interface, `kernels.sample` (Triton) or `kernels.reference.sample` (torch), with
the same arguments.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from kernels import reference

from .outputs import TopLogprob
from .request import Request

_SEED_MASK = (1 << 62) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def step_seed(request_seed: int, output_index: int) -> int:
    """A per-token seed that depends only on the request's seed and the token's index, so a
    seeded request samples the same tokens whatever else is in the batch."""
    return (request_seed * _GOLDEN + output_index * 0xBF58476D1CE4E5B9 + 1) & _SEED_MASK


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[TopLogprob, ...] | None


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor,
                    output_counts: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """logits [B, V]; prompt_mask bool [B, V]; output_counts [B, V]; per-row penalties [B].
    Repetition (CTRL-style, prompt and output tokens): positive logits divided, negative
    multiplied. Presence and frequency (OpenAI-style, output tokens only): subtracted."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).to(logits.dtype)


class Sampler:
    def __init__(self, use_triton: bool, vocab_size: int, seed: int) -> None:
        self._sample = kernels.sample if use_triton else reference.sample
        self.vocab_size = vocab_size
        self._rng = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """logits [B, V] for the B requests that sample this step (in that order)."""
        logits = logits.float()
        device = logits.device
        params = [r.params for r in requests]
        logprobs = None
        if any(p.logprobs is not None for p in params):
            # the model's raw distribution, before bias, min_tokens, penalties and temperature
            # (vLLM's default logprobs mode)
            logprobs = torch.log_softmax(logits, dim=-1)
        if any(p.logit_bias for p in params):
            bias = torch.zeros_like(logits)
            for row, p in enumerate(params):
                for token_id, value in p.logit_bias.items():
                    bias[row, token_id] = value
            logits = logits + bias
        banned_rows = [row for row, r in enumerate(requests)
                       if r.num_output_tokens < r.params.min_tokens]
        for row in banned_rows:
            banned = list(requests[row].eos_token_ids | set(requests[row].params.stop_token_ids))
            logits[row, banned] = float("-inf")
        if any(p.needs_penalties for p in params):
            logits = self._penalise(logits, requests)

        if all(p.greedy for p in params):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample(
                logits,
                torch.tensor([p.temperature for p in params], device=device),
                torch.tensor([p.top_k for p in params], dtype=torch.int32, device=device),
                torch.tensor([p.top_p for p in params], device=device),
                torch.tensor([p.min_p for p in params], device=device),
                self._seeds(requests).to(device))
        return self._outputs(token_ids, logprobs, params)

    def _seeds(self, requests: list[Request]) -> torch.Tensor:
        """[B] int64: one draw from the engine's generator for the batch, then the per-token
        seed of every request that has its own."""
        seeds = torch.randint(0, 1 << 62, (len(requests),), generator=self._rng)
        for row, r in enumerate(requests):
            if r.params.seed is not None:
                seeds[row] = step_seed(r.params.seed, r.num_output_tokens)
        return seeds

    def _penalise(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        batch, vocab = logits.shape
        device = logits.device
        prompt_mask = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        output_counts = torch.zeros(batch, vocab, device=device)
        for row, r in enumerate(requests):
            if r.params.needs_penalties:
                prompt_mask[row, torch.tensor(r.prompt_token_ids, device=device)] = True
                out = r.output_token_ids
                if out:
                    ids = torch.tensor(out, device=device)
                    output_counts[row].index_add_(0, ids, torch.ones(len(out), device=device))
        p = [r.params for r in requests]
        return apply_penalties(
            logits, prompt_mask, output_counts,
            torch.tensor([x.repetition_penalty for x in p], device=device),
            torch.tensor([x.presence_penalty for x in p], device=device),
            torch.tensor([x.frequency_penalty for x in p], device=device))

    @staticmethod
    def _outputs(token_ids: torch.Tensor, logprobs: torch.Tensor | None,
                 params) -> list[SampledToken]:
        ids = token_ids.tolist()
        if logprobs is None:
            return [SampledToken(t, None, None) for t in ids]
        max_n = max(p.logprobs or 0 for p in params)
        top_values, top_ids = (logprobs.topk(max_n, dim=-1) if max_n else (None, None))
        chosen = logprobs.gather(1, token_ids.view(-1, 1).to(logprobs.device)).squeeze(1).tolist()
        outputs = []
        for row, (token_id, p) in enumerate(zip(ids, params)):
            if p.logprobs is None:
                outputs.append(SampledToken(token_id, None, None))
                continue
            top = ()
            if p.logprobs:
                top = tuple(TopLogprob(int(i), float(v)) for i, v in
                            zip(top_ids[row, :p.logprobs].tolist(),
                                top_values[row, :p.logprobs].tolist()))
            outputs.append(SampledToken(token_id, float(chosen[row]), top))
        return outputs
