"""LoRA adapters: a per-request addition to the projections, over any base weight form.

An adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`), or a GGUF
LoRA file as llama.cpp's convert_lora_to_gguf.py writes it (engine/lora_gguf.py), whose
targets are the attention and MLP projections (q, k, v, o, gate, up, down). Its A [r, in] and
B [out, r] pairs are kept by the fused projection they add to (q, k, v -> qkv at their
offsets; gate, up -> gate_up), scaled by lora_alpha / r (rsLoRA: / sqrt(r)).

A step whose rows include an adapter's carries a LoraBatch in its ForwardContext: each
projection's output gets, for every adapter present, x[rows] @ A.T @ B.T * scale added to
its rows and columns (models/decoder.py). The base matmul is untouched, so adapters work over
dense, GGUF-block and int4 weights alike. A decode step under the layers plan (fp32 or bf16)
keeps the layers op, which takes each row's adapter slot and the adapters' packed tensors
(LoraAdapter.packed, kernels/cpu/lora_step.h); any other step with an adapter row runs the
model op by op (the decode graphs take none: engine/model_runner.py). A request's KV cache
blocks are keyed by its adapter (Request.cache_salt), so an adapter never reads the base
model's cached prefix nor another adapter's.

Not yet: the engine calling kernels/triton/lora.py's shrink / expand on CUDA (they are
tested, not wired), tensor parallelism, mixture-of-experts layers. The adapters a step holds:
SchedulerConfig.max_loras (engine/scheduler.py). Loading at run time: server/routes_lora.py.
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

from . import huge_pages
from .errors import InvalidRequestError
from .lora_gguf import is_gguf, read_gguf_adapter
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


GROUPS = ("qkv", "o", "gate_up", "down")  # the layers op's four matmuls a layer, in order
INDEX_WIDTH = 3 + 5 * 3  # kernels/cpu/lora_rows.h's kIndexWidth (three parts at most)
LANES = 16  # and its kLanes: A^T's ranks padded with zeros to a multiple, in chunks of 16
TILE = 64  # and its kTile: B^T in tiles of 64 columns


@dataclass
class LoraAdapter:
    name: str
    rank: int
    dtype: torch.dtype = torch.float32  # the engine's: a bf16 engine's parts are bf16 values
    parts: dict[tuple[int, str], list[LoraPart]] = field(default_factory=dict)
    groups: dict[tuple[int, str], LoraGroup] = field(default_factory=dict)
    _packed: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def packed(self, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(blob, index) as the layers op reads them (kernels/cpu/lora_rows.h): per
        projection 4 l + GROUPS.index(group), the stacked A transposed in chunks of 16 ranks
        (padded to a multiple of 16), then each part's B transposed in tiles of 64 columns;
        made once, in the adapter's dtype (bf16: half the bytes a decode step reads)."""
        if self._packed is None:
            chunks: list[torch.Tensor] = []
            index = torch.zeros(4 * num_layers, INDEX_WIDTH, dtype=torch.int64)
            size = 0

            def put(t: torch.Tensor) -> int:
                nonlocal size
                chunks.append(t.reshape(-1))
                size += t.numel()
                return size - t.numel()

            for (layer, group), stacked in sorted(self.groups.items()):
                row = index[4 * layer + GROUPS.index(group)]
                ranks, k = stacked.a.shape
                padded = -(-ranks // LANES) * LANES
                at = torch.zeros(k, padded)
                at[:, :ranks] = stacked.a.T  # [K, rank] -> chunks of 16 ranks, each [K, 16]
                at = at.reshape(k, padded // LANES, LANES).permute(1, 0, 2)
                row[0], row[1], row[2] = put(at.contiguous()), padded, len(stacked.bs)
                for j, (b, start, end, offset) in enumerate(stacked.bs):
                    n, r = b.shape  # B^T [r, n] -> tiles of 64 columns, each [r, 64]
                    tiles = -(-n // TILE)
                    bt = torch.zeros(r, tiles * TILE)
                    bt[:, :n] = b.T
                    bt = bt.reshape(r, tiles, TILE).permute(1, 0, 2)
                    row[3 + 5 * j:8 + 5 * j] = torch.tensor(
                        [start, end, offset, n, put(bt.contiguous())])
            blob = (torch.cat(chunks) if chunks else torch.zeros(0)).to(self.dtype)
            # on huge pages, as the base weights (huge_pages.py): a step streams all of it
            # (9.8 MB a token for rank 16 on SmolLM2, at about half the blocks' rate on 4 KiB
            # pages and on 2 MiB pages alike: docs/perf-log/2026-12-07-xeon-amx-prefill-lora.md)
            self._packed = (huge_pages.gather([blob.contiguous()])[0], index)
        return self._packed

    @property
    def cache_salt(self) -> bytes:
        """The root of its requests' prefix-cache chains (kv_cache.py)."""
        return hashlib.sha256(b"lora\0" + self.name.encode()).digest()


def _fail(name: str, problem: str) -> None:
    raise InvalidRequestError("lora_modules", f"adapter {name!r}: {problem}")


def load_adapter(name: str, path: str | Path, arch: ModelArch, max_rank: int = 64,
                 dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """A PEFT adapter folder or a llama.cpp GGUF LoRA file (engine/lora_gguf.py) for this
    base (InvalidRequestError naming the problem: missing files, a rank above max_rank,
    targets or shapes the base does not have). dtype: the engine's; its A and scaled B are
    rounded to it (kept in fp32 tensors for the torch path), so the layers op's packed copy
    and the op-by-op path add the same values, as vLLM keeps adapters in the model's dtype."""
    path = Path(path)
    if path.is_file() and is_gguf(path):
        rank, scale, pairs = read_gguf_adapter(name, path, arch)
    else:
        rank, scale, pairs = _read_peft(name, path, arch)
    if not 0 < rank <= max_rank:
        _fail(name, f"rank {rank} is not in [1, {max_rank}] (--max-lora-rank)")
    targets = _targets(arch)
    adapter = LoraAdapter(name, rank, dtype if dtype == torch.bfloat16 else torch.float32)
    rounded = adapter.dtype
    in_sizes = {"qkv": arch.hidden_size, "o": arch.num_heads * arch.head_dim,
                "gate_up": arch.hidden_size, "down": arch.intermediate_size}
    for (layer, module), pair in sorted(pairs.items()):
        if module not in targets:
            _fail(name, f"layer {layer} {module}: this server adapts the q, k, v, o, gate, "
                  "up and down projections only")
        if layer >= arch.num_layers:
            _fail(name, f"layer {layer} {module}: the base has {arch.num_layers} layers")
        group, offset, rows = targets[module]
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.shape != (rank, in_sizes[group]) \
                or b.shape != (rows, rank):
            _fail(name, f"layer {layer} {module}: A {tuple(a.shape) if a is not None else None}"
                  f", B {tuple(b.shape) if b is not None else None} do not fit this base "
                  f"(A [{rank}, {in_sizes[group]}], B [{rows}, {rank}]): another base model?")
        adapter.parts.setdefault((layer, group), []).append(
            LoraPart(a.to(rounded).float().contiguous(),
                     (b.float() * scale).to(rounded).float().contiguous(), offset))
    adapter.groups = {key: LoraGroup.of(parts) for key, parts in adapter.parts.items()}
    adapter.packed(arch.num_layers)  # at load, not on its first request's step (~30 ms)
    return adapter


def _read_peft(name: str, folder: Path, arch: ModelArch
               ) -> tuple[int, float, dict[tuple[int, str], dict[str, torch.Tensor]]]:
    """(rank, scale, {(layer, module): {"A", "B"}}) of a PEFT folder: lora_alpha / r, or
    lora_alpha / sqrt(r) for rsLoRA."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        _fail(name, f"not a PEFT adapter folder ({exc})")
    rank = int(config.get("r", 0))
    if config.get("modules_to_save") or config.get("bias", "none") != "none":
        _fail(name, "modules_to_save and trained biases are not supported")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else max(rank, 1))
    targets = _targets(arch)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in targets:
            _fail(name, f"{key} targets what this server does not adapt (q, k, v, o, gate, "
                  "up and down projections only)")
        pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    return rank, scale, pairs


@dataclass(frozen=True)
class LoraBatch:
    """A step's adapters: (adapter, the hidden-state rows of its requests). stack / slots:
    the Triton path, where the step adds through kernels/triton/lora.py (punica's BGMV: every
    row's adapter in one shrink and one expand launch a part) instead of a matmul pair an
    adapter; tiles, when a run of rows is long (a prefill chunk), its segmented form (SGMV);
    all made once a step by batch_of."""

    groups: tuple[tuple[LoraAdapter, torch.Tensor | slice], ...]  # rows: a slice if in a run
    stack: "LoraStack | None" = None  # the groups' adapters stacked by slot
    slots: torch.Tensor | None = None  # each row's slot (its group's index), -1 for the base
    tiles: torch.Tensor | None = None  # SGMV's (first row, rows, slot) tiles; None: BGMV

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> None:
        """out[rows, offset:offset + n] += x[rows] @ A.T @ B.T for each adapter's part (the
        group's A in one matmul)."""
        if self.stack is not None:
            return self.stack.add(out, x, self.slots, layer, group, self.tiles)
        for adapter, rows in self.groups:
            stacked = adapter.groups.get((layer, group))
            if stacked is None:
                continue
            xa = x[rows].float() @ stacked.a.T  # [rows, sum r]
            for b, start, end, offset in stacked.bs:
                # a slice of rows adds in place into the view; index rows scatter back
                out[rows, offset:offset + b.shape[0]] += (xa[:, start:end] @ b.T).to(out.dtype)

    def layers_args(self, rows: int, num_layers: int) -> tuple:
        """The layers op's LoRA arguments for a step of these rows: (each row's slot, -1 for
        the base; the slots' blobs; their indexes)."""
        slots = torch.full((rows,), -1, dtype=torch.int64)
        blobs, indexes = [], []
        for slot, (adapter, where) in enumerate(self.groups):
            slots[where] = slot
            blob, index = adapter.packed(num_layers)
            blobs.append(blob)
            indexes.append(index)
        return slots, blobs, indexes


class LoraStack:
    """The adapters of a step stacked by slot for the Triton kernels: per (layer, group) A
    [slots, R, K] (each adapter's stacked A, its ranks padded with zeros to the widest R) and
    per output part (offset, n) B [slots, n, R] (each adapter's B at its own ranks' columns,
    zeros elsewhere and for an adapter without that part), in the adapters' dtype on the
    step's device. Made once for a set of adapters (the last few sets are kept: a step's set
    repeats while its requests run)."""

    _made: dict = {}
    KEEP = 4

    def __init__(self, adapters: tuple[LoraAdapter, ...], device: torch.device) -> None:
        self.adapters = adapters  # held: the cache's key is their ids
        self.parts: dict[tuple[int, str], tuple[torch.Tensor, list]] = {}
        keys = sorted({key for adapter in adapters for key in adapter.groups})
        for key in keys:
            present = [(s, a.groups[key]) for s, a in enumerate(adapters) if key in a.groups]
            ranks = max(g.a.shape[0] for _, g in present)
            k = present[0][1].a.shape[1]
            a_stack = torch.zeros(len(adapters), ranks, k)
            outputs: dict[tuple[int, int], torch.Tensor] = {}
            for s, group in present:
                a_stack[s, :group.a.shape[0]] = group.a
                for b, start, end, offset in group.bs:
                    b_stack = outputs.setdefault(
                        (offset, b.shape[0]), torch.zeros(len(adapters), b.shape[0], ranks))
                    b_stack[s, :, start:end] = b
            dtype = adapters[0].dtype
            self.parts[key] = (a_stack.to(device, dtype), [
                (offset, b_stack.to(device, dtype)) for (offset, _), b_stack in
                sorted(outputs.items())])

    @classmethod
    def of(cls, adapters: tuple[LoraAdapter, ...], device: torch.device) -> "LoraStack":
        key = (tuple(id(a) for a in adapters), str(device))
        if key not in cls._made:
            while len(cls._made) >= cls.KEEP:
                cls._made.pop(next(iter(cls._made)))
            cls._made[key] = cls(adapters, device)
        return cls._made[key]

    def add(self, out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, layer: int,
            group: str, tiles: torch.Tensor | None = None) -> None:
        """tiles: the segmented kernels' (SGMV) tiles of the same rows, else BGMV by slots."""
        from tritonserve.kernels.triton import lora as kernels
        found = self.parts.get((layer, group))
        if found is None:
            return
        a_stack, outputs = found
        if tiles is not None:
            xa = kernels.sgmv_shrink(x.contiguous(), a_stack, tiles)
            for offset, b_stack in outputs:
                kernels.sgmv_expand(out, xa, b_stack, tiles, offset)
            return
        xa = kernels.lora_shrink(x.contiguous(), a_stack, slots)
        for offset, b_stack in outputs:
            kernels.lora_expand(out, xa, b_stack, slots, offset)


def batch_of(adapters: list[LoraAdapter | None], rows_per: list[int],
             kernels_on: torch.device | None = None) -> LoraBatch | None:
    """The LoraBatch of a step whose requests (in row order) hold these adapters and rows;
    None when none has one. kernels_on: add through the Triton kernels, the rows' slots on
    this device (LoraBatch)."""
    if not any(adapters):
        return None
    rows: dict[str, list[int]] = {}
    by_name: dict[str, LoraAdapter] = {}
    runs: list[tuple[int, int, str]] = []  # each request's rows: (first, count, adapter)
    start = 0
    for adapter, count in zip(adapters, rows_per):
        if adapter is not None:
            rows.setdefault(adapter.name, []).extend(range(start, start + count))
            by_name[adapter.name] = adapter
            runs.append((start, count, adapter.name))
        start += count
    groups = tuple((by_name[name], _rows(r)) for name, r in rows.items())
    if kernels_on is None:
        return LoraBatch(groups)
    from tritonserve.kernels.triton.lora import SGMV_MIN_ROWS, sgmv_tiles
    slots = torch.full((start,), -1, dtype=torch.int32)
    for slot, (_, where) in enumerate(groups):
        slots[where] = slot
    tiles = None
    if max(count for _, count, _ in runs) >= SGMV_MIN_ROWS:
        slot_of = {name: slot for slot, name in enumerate(rows)}
        tiles = sgmv_tiles([(first, count, slot_of[name]) for first, count, name in runs
                            if count], kernels_on)
    return LoraBatch(groups, LoraStack.of(tuple(a for a, _ in groups), kernels_on),
                     slots.to(kernels_on), tiles)


def _rows(rows: list[int]) -> torch.Tensor | slice:
    """A run of consecutive rows as a slice (a view, no gather), else an index tensor."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.long)
