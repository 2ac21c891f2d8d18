"""Speculative decoding with n-gram proposals (`--speculative-method ngram`): the proposer,
which requests may speculate, and the exact verification of a request's proposals.

Proposals (vLLM's prompt lookup): the last n tokens of the request (prompt + output), for n
from ngram_max down to ngram_min, are looked up earlier in the same tokens; the latest earlier
match proposes the up to K tokens that followed it. No match, no proposal, no model cost.

Verification runs the request's last token and its K proposals as K + 1 rows of one decode
step (engine/model_runner.py), each row attending to the positions before it, so the step
reads the weights once for K + 1 tokens. Row j's logits are the target model's distribution
for position j given the proposals before it; `verify` accepts proposals in order:
- greedy: while the argmax equals the proposal; the first disagreeing argmax (or, when all
  K agree, row K's argmax) is the bonus token. Token-identical to decoding without proposals.
- sampling: the proposal t is accepted with probability p(t) (p: row j's distribution after
  temperature, top-k, top-p and min-p, exactly as the sampler filters it); on a rejection the
  token is drawn from p with t removed and renormalised; when all are accepted row K gives a
  bonus draw. For a deterministic proposal this is rejection sampling with q = the point mass
  at t: every emitted token has exactly the target distribution.

A request whose proposals keep failing stops proposing for a while (`worth_proposing`): each
rejected row costs a share of a step (a 4-row step took ~1.5x a 1-row one on the embedded
model, docs/benchmarks.md), so text with chance one-token matches would run slower.

What cannot be kept exact yet runs without speculation (`eligible`): penalties, logit_bias
and min_tokens (their state would have to move per position), a seed (the per-position seeded
draw would change), a grammar, and logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonserve.kernels.reference import _thresholds

from .request import Request
from .sampler import SampledToken

METHODS = ("ngram",)
# decode rows whose bf16 sums do not depend on the rows beside them, on quantized weights
# (kernels/cpu/panels_quant.h's kSplit: tile_bf16 sums up to it as row_bf16 does); a
# speculating step stays within it so that greedy output is one row's
BF16_INVARIANT_ROWS = 4


class NgramProposer:
    def __init__(self, num_tokens: int, ngram_min: int, ngram_max: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}")
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram_min and ngram_max must satisfy 1 <= ngram_min <= "
                             f"ngram_max, got {ngram_min} and {ngram_max}")
        self.k, self.ngram_min, self.ngram_max = num_tokens, ngram_min, ngram_max

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(K, limit) tokens that followed the latest earlier occurrence of the
        longest matching suffix."""
        limit = min(self.k, limit)
        if limit <= 0:
            return []
        size = len(tokens)
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            suffix = tokens[size - n:]
            first = suffix[0]
            # the latest start i < size - n whose n tokens equal the suffix
            for i in range(size - n - 1, -1, -1):
                if tokens[i] == first and tokens[i:i + n] == suffix:
                    return tokens[i + n:i + n + limit]
        return []


@dataclass
class SpecStats:
    """Since start: proposals verified, proposals accepted, speculating request-steps."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1


ACCEPTANCE_DECAY = 0.7  # the running mean keeps this much of its past at each verification
ACCEPTANCE_RECOVERY = 0.02  # a step without proposals regains this much: tries again in ~10


def worth_proposing(request: Request, floor: float) -> bool:
    """floor: SpeculativeConfig.min_acceptance."""
    if request.spec_acceptance >= floor:
        return True
    request.spec_acceptance += ACCEPTANCE_RECOVERY
    return False


def record_acceptance(request: Request, proposed: int, accepted: int) -> None:
    request.spec_acceptance = (ACCEPTANCE_DECAY * request.spec_acceptance
                               + (1 - ACCEPTANCE_DECAY) * accepted / proposed)


def eligible(request: Request) -> bool:
    """Whether the request's output can be verified exactly (see the module docstring)."""
    p = request.params
    return (not p.needs_penalties and not p.logit_bias and p.min_tokens == 0
            and p.seed is None and p.structured is None and p.logprobs is None
            and request.matcher is None and request.held_matcher is None)


def verify(logits: torch.Tensor, proposals: list[int], request: Request,
           generator: torch.Generator | None = None) -> list[SampledToken]:
    """logits [K + 1, V]: rows for the last token and each proposal -> the tokens emitted
    (the accepted proposals, then one more)."""
    p = request.params
    if p.greedy:
        best = logits.argmax(dim=-1).tolist()
        out = []
        for j, proposal in enumerate(proposals):
            if best[j] != proposal:
                return out + [SampledToken(best[j], None, None)]
            out.append(SampledToken(proposal, None, None))
        return out + [SampledToken(best[len(proposals)], None, None)]
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)  # [K + 1, V]
    if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
        rows = probs.shape[0]
        keep = probs >= _thresholds(
            probs, torch.full((rows,), p.top_k, dtype=torch.int64),
            torch.full((rows,), p.top_p), torch.full((rows,), p.min_p))[:, None]
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    uniforms = torch.rand(len(proposals), generator=generator, dtype=torch.float64).tolist()
    out = []
    for j, proposal in enumerate(proposals):
        if uniforms[j] < float(probs[j, proposal]):
            out.append(SampledToken(proposal, None, None))
            continue
        residual = probs[j].clone()
        residual[proposal] = 0.0
        token = int(torch.multinomial(residual, 1, generator=generator))
        return out + [SampledToken(token, None, None)]
    token = int(torch.multinomial(probs[len(proposals)], 1, generator=generator))
    return out + [SampledToken(token, None, None)]
