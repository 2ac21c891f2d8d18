"""The sampling rows of `bench kernels`: our samplers against the baselines a user would
otherwise run, on the same logits and parameters.

- "triton": kernels.sample (CUDA only);
- "torch (ours)": kernels.reference.sample, the CPU engine's path (runs on either device);
- "torch topk/sort + multinomial": what a plain torch engine does (vLLM's native fallback
  shape): temperature, `topk` when every row has a top-k, else a full sort for top-p, softmax,
  `multinomial`;
- "flashinfer": flashinfer.sampling, when it imports (CUDA only).
"""
from __future__ import annotations

from typing import Callable

import torch

from tritonserve.kernels import triton as kernels

from tritonserve.kernels import reference

CASES = (  # name, temperature, top_k (-1 off), top_p
    ("sample T=1", 1.0, -1, 1.0),
    ("sample T=1 top-p 0.95", 1.0, -1, 0.95),
    ("sample T=0.8 top-k 50 top-p 0.9", 0.8, 50, 0.9),
)


def torch_baseline(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    x = logits / temperature[:, None]
    if bool((top_k > 0).all()):
        x, ids = x.topk(int(top_k.max()), dim=-1)  # sorted, descending
    elif bool((top_p < 1).any()):
        x, ids = x.sort(dim=-1, descending=True)
    else:
        return torch.multinomial(torch.softmax(x, dim=-1), 1).squeeze(1)
    probs = torch.softmax(x, dim=-1)
    if bool((top_p < 1).any()):
        outside = probs.cumsum(dim=-1) - probs > top_p[:, None]
        probs = probs.masked_fill(outside, 0.0)
    return ids.gather(1, torch.multinomial(probs, 1)).squeeze(1)


def _flashinfer(temperature: float, top_k: int, top_p: float):
    try:
        from flashinfer import sampling
    except Exception:  # noqa: BLE001 - not installed, or built for another torch
        return None

    def run(logits: torch.Tensor) -> torch.Tensor:
        x = logits / temperature
        if top_k > 0:
            return sampling.top_k_top_p_sampling_from_logits(x, top_k, top_p)
        probs = torch.softmax(x, dim=-1)
        if top_p < 1:
            return sampling.top_p_sampling_from_probs(probs, top_p)
        return sampling.sampling_from_probs(probs)
    return run


def sampling_rows(batch: int, vocab: int, device: str,
                  measure: Callable, add: Callable) -> None:
    """Calls add(kernel, impl, ms, bytes) for every case and every implementation present."""
    logits = torch.randn(batch, vocab, device=device) * 3  # peaked like real logits
    nbytes = batch * vocab * 4
    for name, t, k, p in CASES:
        params = (torch.full((batch,), t, device=device),
                  torch.full((batch,), k, dtype=torch.int32, device=device),
                  torch.full((batch,), p, device=device), torch.zeros(batch, device=device),
                  torch.arange(batch, device=device))
        if device == "cuda":
            add(name, "triton", measure(lambda: kernels.sample(logits, *params)), nbytes)
        add(name, "torch (ours)", measure(lambda: reference.sample(logits, *params)), nbytes)
        add(name, "torch topk/sort + multinomial", measure(
            lambda: torch_baseline(logits, params[0], params[1], params[2])), nbytes)
        flashinfer = _flashinfer(t, k, p) if device == "cuda" else None
        if flashinfer is not None:
            add(name, "flashinfer", measure(lambda: flashinfer(logits)), nbytes)
