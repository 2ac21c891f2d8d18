"""Per-request sampling tensors kept across steps, lent to a request on its first sample and
returned when it ends: token counts and the set of seen tokens for the penalties, logit_bias
entries and min_tokens bans.

The step never loops over rows or vocabulary entries in tensor code: a request's tensors are
written once (prompt tokens, bias, banned ids) when it first samples, its counts grow by a few
batched ops per step, and each step touches only the entries that matter (the tokens a row has
seen, a few hundred; its bias and banned ids) with one gather/scatter for the batch, never a
dense [B, V] pass. Requests with default parameters hold nothing.

Measured on [64, 49152] at T=1 with repetition 1.1 on every row (100-token prompts, 128
outputs), the whole sampler call: 89 ms when the [B, V] count and mask tensors were rebuilt in
Python loops and penalised densely (~16 passes over [B, V]), 11 ms now (6.7 ms without
penalties); with frequency, logit_bias and min_tokens too: 106 -> 11.5 ms.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request


class RowPool:
    """Rows of a [capacity, width] tensor lent out one at a time; doubles when full. A row
    comes back zeroed (or False)."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 8) -> None:
        self.tensor = torch.zeros(capacity, width, dtype=dtype, device=device)
        self._free = list(range(capacity - 1, -1, -1))

    def acquire(self) -> int:
        if not self._free:
            capacity = self.tensor.shape[0]
            self.tensor = torch.cat([self.tensor, torch.zeros_like(self.tensor)])
            self._free = list(range(2 * capacity - 1, capacity - 1, -1))
        return self._free.pop()

    def release(self, row: int) -> None:
        self.tensor[row].zero_()
        self._free.append(row)

    @property
    def rows_in_use(self) -> int:
        return self.tensor.shape[0] - len(self._free)


class PenaltyRows:
    """One row per penalised request across four tensors:
    counts [R, V] float (output tokens), in_prompt [R, V] bool, seen [R, W] int64 (the distinct
    tokens of prompt and output, in first-seen order; W = min(V, max_model_len)) and
    num_seen [R] int64."""

    def __init__(self, vocab_size: int, max_model_len: int, device: torch.device) -> None:
        self.device = device
        self.counts = RowPool(vocab_size, torch.float32, device)
        self.in_prompt = RowPool(vocab_size, torch.bool, device)
        self.seen = RowPool(min(vocab_size, max_model_len), torch.int64, device)
        self.num_seen = RowPool(1, torch.int64, device)

    def acquire(self, prompt: list[int], output: list[int]) -> int:
        row = self.counts.acquire()
        for pool in (self.in_prompt, self.seen, self.num_seen):
            pool.acquire()  # the pools grow and lend in lockstep: same row everywhere
        prompt_ids = torch.tensor(prompt, dtype=torch.int64, device=self.device)
        self.in_prompt.tensor[row, prompt_ids] = True
        if output:  # only after a recompute
            ids, n = torch.tensor(output, device=self.device).unique(return_counts=True)
            self.counts.tensor[row, ids] = n.float()
            prompt_ids = torch.cat([prompt_ids, ids])
        distinct = prompt_ids.unique()
        self.seen.tensor[row, :len(distinct)] = distinct
        self.num_seen.tensor[row] = len(distinct)
        return row

    def release(self, row: int) -> None:
        for pool in (self.counts, self.in_prompt, self.seen, self.num_seen):
            pool.release(row)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """rows [S] distinct pool rows; tokens [S] just drawn for them."""
        new = (self.counts.tensor[rows, tokens] == 0) & ~self.in_prompt.tensor[rows, tokens]
        self.counts.tensor.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32),
                                      accumulate=True)
        new_rows = rows[new]
        num_seen = self.num_seen.tensor[new_rows, 0]
        self.seen.tensor[new_rows, num_seen] = tokens[new]
        self.num_seen.tensor[new_rows, 0] = num_seen + 1

    def apply(self, logits: torch.Tensor, at: torch.Tensor, rows: torch.Tensor,
              repetition: torch.Tensor, presence: torch.Tensor,
              frequency: torch.Tensor) -> None:
        """In place on the seen tokens of logits [B, V] rows `at` [S] (pool rows `rows` [S];
        penalties [S]); the same values as apply_penalties on the dense rows."""
        num_seen = self.num_seen.tensor[rows, 0]  # [S]
        width = int(num_seen.max())
        ids = self.seen.tensor[rows, :width]  # [S, W]; padding (id 0) masked below
        valid = torch.arange(width, device=self.device)[None, :] < num_seen[:, None]
        batch_rows = at[:, None].expand_as(ids)
        values = logits[batch_rows, ids]  # [S, W]
        counts = self.counts.tensor[rows[:, None], ids]
        rep = repetition[:, None]
        values = torch.where(values > 0, values / rep, values * rep)
        values = values - frequency[:, None] * counts - presence[:, None] * (counts > 0)
        logits[batch_rows[valid], ids[valid]] = values[valid]


@dataclass(frozen=True)
class _Rows:
    penalty: int | None  # row in PenaltyRows
    bias_ids: torch.Tensor | None  # [n] int64, logit_bias keys
    bias: torch.Tensor | None  # [n] float, logit_bias values
    banned: torch.Tensor | None  # [m] int64 held back until min_tokens: EOS, stop_token_ids


def _at(batch_rows: list[int], lengths: list[int], device: torch.device) -> torch.Tensor:
    """The batch row of each entry when entries of several rows are concatenated."""
    return torch.repeat_interleave(torch.tensor(batch_rows, device=device),
                                   torch.tensor(lengths, device=device))


class SamplingState:
    """Owned by the Sampler. Contract: `apply` before the draw, `record` with the drawn tokens,
    `release` once per finished request (a no-op for one that never sampled)."""

    def __init__(self, vocab_size: int, max_model_len: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.penalties = PenaltyRows(vocab_size, max_model_len, device)
        self._rows: dict[str, _Rows] = {}

    def _ids(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _rows_of(self, request: Request) -> _Rows:
        rows = self._rows.get(request.request_id)
        if rows is None:
            p = request.params
            rows = _Rows(
                penalty=(self.penalties.acquire(request.prompt_token_ids,
                                                request.output_token_ids)
                         if p.needs_penalties else None),
                bias_ids=self._ids(list(p.logit_bias)) if p.logit_bias else None,
                bias=(torch.tensor(list(p.logit_bias.values()), device=self.device)
                      if p.logit_bias else None),
                banned=(self._ids(sorted(request.eos_token_ids | set(p.stop_token_ids)))
                        if p.min_tokens else None))
            self._rows[request.request_id] = rows
        return rows

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits [B, V] for `requests` -> the same tensor with bias, min_tokens bans and
        penalties applied in place (each a gather/scatter over the entries it touches)."""
        rows = [self._rows_of(r) for r in requests]
        biased = [(i, x) for i, x in enumerate(rows) if x.bias is not None]
        if biased:
            at = _at([i for i, _ in biased], [len(x.bias) for _, x in biased], self.device)
            logits.index_put_((at, torch.cat([x.bias_ids for _, x in biased])),
                              torch.cat([x.bias for _, x in biased]), accumulate=True)
        banned = [(i, x) for i, (x, r) in enumerate(zip(rows, requests))
                  if x.banned is not None and r.num_output_tokens < r.params.min_tokens]
        if banned:
            at = _at([i for i, _ in banned], [len(x.banned) for _, x in banned], self.device)
            logits[at, torch.cat([x.banned for _, x in banned])] = float("-inf")
        penalised = [(i, x.penalty) for i, x in enumerate(rows) if x.penalty is not None]
        if penalised:
            at, pool_rows = map(self._ids, zip(*penalised))
            p = [requests[i].params for i, _ in penalised]
            self.penalties.apply(
                logits, at, pool_rows,
                torch.tensor([x.repetition_penalty for x in p], device=self.device),
                torch.tensor([x.presence_penalty for x in p], device=self.device),
                torch.tensor([x.frequency_penalty for x in p], device=self.device))
        return logits

    def record(self, requests: list[Request], token_ids: torch.Tensor) -> None:
        """token_ids [B]: the tokens just drawn for `requests`; counted for the penalties."""
        if not self.penalties.counts.rows_in_use:  # the usual step: nobody is penalised
            return
        at = [(i, rows.penalty) for i, r in enumerate(requests)
              if (rows := self._rows.get(r.request_id)) is not None and rows.penalty is not None]
        if at:
            batch_rows, pool_rows = map(self._ids, zip(*at))
            self.penalties.record(pool_rows, token_ids.to(self.device)[batch_rows])

    def release(self, request_id: str) -> None:
        rows = self._rows.pop(request_id, None)
        if rows is not None and rows.penalty is not None:
            self.penalties.release(rows.penalty)

    @property
    def num_requests(self) -> int:
        return len(self._rows)


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor,
                    output_counts: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """The dense form (the tests' reference): logits [B, V]; prompt_mask bool [B, V];
    output_counts [B, V]; per-row penalties [B].
    Repetition (CTRL-style, prompt and output tokens): positive logits divided, negative
    multiplied. Presence and frequency (OpenAI-style, output tokens only): subtracted."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).to(logits.dtype)
