"""Embeddings: a prompt's hidden states (after the final norm) pooled into one vector.

How a model pools is read from its checkpoint, as sentence-transformers writes it
(`modules.json` with a Pooling module whose `1_Pooling/config.json` says lasttoken, mean or
cls, and a Normalize module), else `--pooling` (default last-token, normalised: what a
decoder-only embedding model such as Qwen3-Embedding uses). `dimensions` (Matryoshka
truncation) is allowed where the config declares it (`is_matryoshka` or
`matryoshka_dimensions`, vLLM's keys).

An embedding request is a request with SamplingParams.pooling set and max_tokens 0: it is
scheduled and prefilled beside generation like any prompt (chunked under the same token
budget), samples nothing, and ends once its prompt is computed, its step carrying the pooled
vector. The runner accumulates the pool chunk by chunk (pool_rows / pool); "mean" and "cls"
compute every prompt token (no prefix cache), "last" only needs the last one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import POOLING_CHOICES
from .request import Request

KINDS = POOLING_CHOICES[1:]  # last, mean, cls
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class Pooling:
    kind: str  # KINDS
    normalize: bool
    matryoshka: bool  # `dimensions` may truncate the vector
    why: str


def resolve_pooling(folder: Path | None, configured: str = "auto") -> Pooling:
    """The checkpoint's sentence-transformers modules when it has them, else `configured`
    (auto: last-token, normalised)."""
    config = _read(folder / "config.json") if folder else {}
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    if configured != "auto":
        return Pooling(configured, True, matryoshka, "--pooling")
    modules = _read(folder / "modules.json") if folder else None
    if isinstance(modules, list):
        types = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
        if "Pooling" in types:
            st = _read(folder / types["Pooling"] / "config.json") or {}
            kind = next((k for key, k in _ST_MODES.items() if st.get(key)), None)
            if kind is not None:
                return Pooling(kind, "Normalize" in types, matryoshka,
                               f"the checkpoint's {types['Pooling']}/config.json")
    return Pooling("last", True, matryoshka, "default (a decoder-only model: its last token)")


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def finish(vector, normalize: bool, dimensions: int | None = None) -> list[float]:
    """The pooled vector as served: truncated to `dimensions`, then L2-normalised (in torch:
    the embeddings route runs this on the event loop for up to --max-waiting inputs)."""
    values = torch.tensor(vector[:dimensions] if dimensions else vector, dtype=torch.float64)
    if normalize:
        values = values / (values.norm() or 1.0)
    return values.tolist()


# ---- in the runner -------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolRows:
    """Rows [first, first + count) of a step's hidden states: prompt positions start.. of a
    pooling request."""

    request: Request
    first: int
    start: int
    count: int


def pool_rows(request: Request, start: int, end: int, first_row: int) -> PoolRows | None:
    """The rows of a chunk computing positions [start, end) that its pool reads."""
    kind = request.params.pooling
    if kind is None:
        return None
    end = min(end, request.num_prompt_tokens)
    if kind == "last":
        last = request.num_prompt_tokens - 1
        return PoolRows(request, first_row + last - start, last, 1) if start <= last < end \
            else None
    if kind == "cls":
        return PoolRows(request, first_row, 0, 1) if start == 0 < end else None
    return PoolRows(request, first_row, start, end - start) if start < end else None


def pool(hidden: torch.Tensor, rows: tuple[PoolRows, ...]) -> None:
    """Adds each part's rows to its request's pool (a recompute after preemption starts
    over at position 0)."""
    for part in rows:
        request = part.request
        rows_sum = hidden[part.first:part.first + part.count].float().sum(dim=0)
        if part.start == 0 or request.pooled is None:
            request.pooled, request.pooled_rows = rows_sum, part.count
        else:
            request.pooled = request.pooled + rows_sum
            request.pooled_rows += part.count


def pooled_vector(request: Request) -> tuple[float, ...]:
    """The request's pool once its prompt is computed: the mean of its rows (one row for last
    and cls)."""
    return tuple((request.pooled / max(request.pooled_rows, 1)).tolist())
