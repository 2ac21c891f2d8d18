"""LoRA adapters: a per-request addition to the projections, over any base weight form.

An adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) whose
targets are the attention and MLP projections (q, k, v, o, gate, up, down). Its A [r, in] and
B [out, r] pairs are kept by the fused projection they add to (q, k, v -> qkv at their
offsets; gate, up -> gate_up), scaled by lora_alpha / r (rsLoRA: / sqrt(r)).

A step whose rows include an adapter's carries a LoraBatch in its ForwardContext: each
projection's output gets, for every adapter present, x[rows] @ A.T @ B.T * scale added to
its rows and columns (models/decoder.py). The base matmul is untouched, so adapters work over
dense, GGUF-block and int4 weights alike. Such a step runs the model op by op (the layers op
and the decode graphs take no adapter: engine/model_runner.py); a request's KV cache blocks
are keyed by its adapter (Request.cache_salt), so an adapter never reads the base model's
cached prefix nor another adapter's.

Not yet: the engine calling kernels/triton/lora.py's shrink / expand on CUDA (they are
tested, not wired), a C++ path and adapters in the layers op, tensor parallelism,
mixture-of-experts layers, llama.cpp's GGUF LoRA files. Loading at run time:
server/routes_lora.py.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from .errors import InvalidRequestError
from .models.arch import ModelArch

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


def _targets(arch: ModelArch) -> dict[str, tuple[str, int, int]]:
    """PEFT module name -> (the fused projection it adds to, its output offset, its rows)."""
    q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    return {"q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, kv), "v_proj": ("qkv", q + kv, kv),
            "o_proj": ("o", 0, arch.hidden_size), "gate_proj": ("gate_up", 0, inter),
            "up_proj": ("gate_up", inter, inter), "down_proj": ("down", 0, arch.hidden_size)}


@dataclass(frozen=True)
class LoraPart:
    a: torch.Tensor  # [r, in], fp32
    b: torch.Tensor  # [out rows, r], fp32, the scale folded in
    offset: int  # its first output column in the fused projection


@dataclass(frozen=True)
class LoraGroup:
    """A fused projection's parts: their A stacked ([sum r, in]: one matmul for q, k and v),
    each B with its slice of the stacked ranks and its output columns."""

    a: torch.Tensor
    bs: tuple[tuple[torch.Tensor, int, int, int], ...]  # (B, rank start, rank end, offset)

    @classmethod
    def of(cls, parts: list[LoraPart]) -> "LoraGroup":
        bs, start = [], 0
        for part in parts:
            rank = part.a.shape[0]
            bs.append((part.b, start, start + rank, part.offset))
            start += rank
        return cls(torch.cat([p.a for p in parts]).contiguous(), tuple(bs))


@dataclass
class LoraAdapter:
    name: str
    rank: int
    parts: dict[tuple[int, str], list[LoraPart]] = field(default_factory=dict)
    groups: dict[tuple[int, str], LoraGroup] = field(default_factory=dict)

    @property
    def cache_salt(self) -> bytes:
        """The root of its requests' prefix-cache chains (kv_cache.py)."""
        return hashlib.sha256(b"lora\0" + self.name.encode()).digest()


def _fail(name: str, problem: str) -> None:
    raise InvalidRequestError("lora_modules", f"adapter {name!r}: {problem}")


def load_adapter(name: str, folder: str | Path, arch: ModelArch,
                 max_rank: int = 64) -> LoraAdapter:
    """A PEFT adapter for this base (InvalidRequestError naming the problem: missing files,
    a rank above max_rank, targets or shapes the base does not have)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        _fail(name, f"not a PEFT adapter folder ({exc})")
    rank = int(config.get("r", 0))
    if not 0 < rank <= max_rank:
        _fail(name, f"rank {rank} is not in [1, {max_rank}] (--max-lora-rank)")
    if config.get("modules_to_save") or config.get("bias", "none") != "none":
        _fail(name, "modules_to_save and trained biases are not supported")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    targets = _targets(arch)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in targets:
            _fail(name, f"{key} targets what this server does not adapt (q, k, v, o, gate, "
                  "up and down projections only)")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= arch.num_layers:
            _fail(name, f"{key}: the base has {arch.num_layers} layers")
        pairs.setdefault((layer, module), {})[which] = tensor.float()
    adapter = LoraAdapter(name, rank)
    in_sizes = {"qkv": arch.hidden_size, "o": arch.num_heads * arch.head_dim,
                "gate_up": arch.hidden_size, "down": arch.intermediate_size}
    for (layer, module), pair in sorted(pairs.items()):
        group, offset, rows = targets[module]
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.shape != (rank, in_sizes[group]) \
                or b.shape != (rows, rank):
            _fail(name, f"layer {layer} {module}: A {tuple(a.shape) if a is not None else None}"
                  f", B {tuple(b.shape) if b is not None else None} do not fit this base "
                  f"(A [{rank}, {in_sizes[group]}], B [{rows}, {rank}]): another base model?")
        adapter.parts.setdefault((layer, group), []).append(
            LoraPart(a.contiguous(), (b * scale).contiguous(), offset))
    adapter.groups = {key: LoraGroup.of(parts) for key, parts in adapter.parts.items()}
    return adapter


@dataclass(frozen=True)
class LoraBatch:
    """A step's adapters: (adapter, the hidden-state rows of its requests)."""

    groups: tuple[tuple[LoraAdapter, torch.Tensor | slice], ...]  # rows: a slice if in a run

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> None:
        """out[rows, offset:offset + n] += x[rows] @ A.T @ B.T for each adapter's part (the
        group's A in one matmul)."""
        for adapter, rows in self.groups:
            stacked = adapter.groups.get((layer, group))
            if stacked is None:
                continue
            xa = x[rows].float() @ stacked.a.T  # [rows, sum r]
            for b, start, end, offset in stacked.bs:
                # a slice of rows adds in place into the view; index rows scatter back
                out[rows, offset:offset + b.shape[0]] += (xa[:, start:end] @ b.T).to(out.dtype)


def batch_of(adapters: list[LoraAdapter | None], rows_per: list[int]) -> LoraBatch | None:
    """The LoraBatch of a step whose requests (in row order) hold these adapters and rows;
    None when none has one."""
    if not any(adapters):
        return None
    rows: dict[str, list[int]] = {}
    by_name: dict[str, LoraAdapter] = {}
    start = 0
    for adapter, count in zip(adapters, rows_per):
        if adapter is not None:
            rows.setdefault(adapter.name, []).extend(range(start, start + count))
            by_name[adapter.name] = adapter
        start += count
    return LoraBatch(tuple((by_name[name], _rows(r)) for name, r in rows.items()))


def _rows(rows: list[int]) -> torch.Tensor | slice:
    """A run of consecutive rows as a slice (a view, no gather), else an index tensor."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.long)
