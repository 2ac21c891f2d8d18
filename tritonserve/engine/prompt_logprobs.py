"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's log-probability given
the tokens before it, read off the logits of the prefill rows that already run.

The runner (engine/model_runner.py) marks, per prefill chunk, the rows whose next token is a
prompt token (PromptRows); after the forward, score() turns those rows' hidden states into
logits a slice at a time (a 2048-row chunk's logits over a 49k vocabulary would be 400 MB at
once) and appends one PromptLogprob per row to its request. The values are the raw model's
(vLLM's default logprobs mode): no temperature, penalty or bias, as lm-eval's loglikelihoods
expect.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .outputs import PromptLogprob, TopLogprob
from .request import Request

ROWS_PER_SLICE = 256  # logits [256, vocab] fp32 at a time: 50 MB for a 49k vocabulary


@dataclass(frozen=True)
class PromptRows:
    """Rows [first, first + count) of a step's hidden states: row j is the prompt position
    whose logits predict prompt token targets[j]."""

    request: Request
    first: int
    targets: tuple[int, ...]


def rows_of(request: Request, start: int, end: int, first_row: int) -> PromptRows | None:
    """The prompt rows of a chunk computing positions [start, end) at hidden rows from
    first_row: positions whose next token is a prompt token whose entry is not yet collected
    (a recompute after preemption skips those)."""
    if request.params.prompt_logprobs is None:
        return None
    lo = max(start, len(request.prompt_logprobs))
    hi = min(end, request.num_prompt_tokens - 1)
    if lo >= hi:
        return None
    targets = tuple(request.prompt_token_ids[lo + 1:hi + 1])
    return PromptRows(request, first_row + lo - start, targets)


def score(hidden: torch.Tensor, rows: tuple[PromptRows, ...], compute_logits) -> None:
    """Appends each row's PromptLogprob to its request (compute_logits: hidden -> logits)."""
    for part in rows:
        top_n = part.request.params.prompt_logprobs
        for at in range(0, len(part.targets), ROWS_PER_SLICE):
            targets = part.targets[at:at + ROWS_PER_SLICE]
            first = part.first + at
            logits = compute_logits(hidden[first:first + len(targets)]).float()
            logprobs = torch.log_softmax(logits, dim=-1)
            ids = torch.tensor(targets, dtype=torch.long, device=logprobs.device)
            chosen = logprobs.gather(1, ids.view(-1, 1))
            ranks = (logprobs > chosen).sum(dim=1).add_(1).tolist()
            chosen = chosen.squeeze(1).tolist()
            if top_n:
                values, top_ids = logprobs.topk(top_n, dim=-1)
                tops = [tuple(TopLogprob(i, v) for i, v in zip(ids_row, values_row))
                        for ids_row, values_row in zip(top_ids.tolist(), values.tolist())]
            else:
                tops = [()] * len(targets)
            part.request.prompt_logprobs.extend(
                PromptLogprob(t, lp, rank, top)
                for t, lp, rank, top in zip(targets, chosen, ranks, tops))
