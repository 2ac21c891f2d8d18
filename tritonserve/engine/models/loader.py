"""Strict weight loading from a local Hugging Face folder into the fused modules.

Every checkpoint tensor must land somewhere with the right shape, and every parameter slice
must be filled exactly once: missing, unexpected or mis-shaped tensors fail loudly, naming them.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..parallel import Shard
from .arch import ModelArch
from .family import FAMILIES
from .decoder import DecoderForCausalLM, RMSNorm
from .moe import SUMMED, EXPERT_PARAMS, SparseMoE, expert_slots, is_stacked, split_stacked
from .rope import RotaryEmbedding

# Buffers some checkpoints carry that are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    pass


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor goes: rows [start, start + rows) of a parameter; split:
    the dim a tensor-parallel rank takes its share of (0 column-parallel, 1 row-parallel,
    None replicated: engine/parallel.py; moe.SUMMED: a bias before a row-parallel all-reduce,
    rank 0's alone)."""

    param: torch.nn.Parameter
    start: int
    rows: int
    split: int | None = None


def checkpoint_slots(model: DecoderForCausalLM) -> dict[str, WeightSlot]:
    arch = model.arch
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    slots: dict[str, WeightSlot] = {}

    def whole(name: str, param: torch.nn.Parameter, split: int | None = None) -> None:
        slots[name] = WeightSlot(param, 0, param.shape[0], split)

    fused = FAMILIES[arch.family].fused_checkpoint
    whole("model.embed_tokens.weight", model.embed_tokens.weight)
    whole("model.norm.weight", model.norm.weight)
    if not arch.tie_word_embeddings:
        whole("lm_head.weight", model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        suffixes = ("weight", "bias") if arch.qkv_bias else ("weight",)
        for suffix in suffixes:
            qkv = getattr(attn.qkv_proj, suffix)
            if fused:  # one tensor: a tensor-parallel rank cannot take a row range of it
                whole(f"{p}self_attn.qkv_proj.{suffix}", qkv)
                continue
            for name, start, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                slots[f"{p}self_attn.{name}_proj.{suffix}"] = WeightSlot(qkv, start, rows, 0)
        whole(f"{p}self_attn.o_proj.weight", attn.o_proj.weight, split=1)
        if arch.variant.o_bias:
            whole(f"{p}self_attn.o_proj.bias", attn.o_proj.bias, split=SUMMED)
        if arch.variant.sinks:
            whole(f"{p}self_attn.sinks", attn.sinks, split=0)
        if arch.qk_norm:
            whole(f"{p}self_attn.q_norm.weight", attn.q_norm.weight)
            whole(f"{p}self_attn.k_norm.weight", attn.k_norm.weight)
        for norm in layer.norm_names:  # the variant's placement (family.py: norm_names)
            whole(f"{p}{norm}.weight", getattr(layer, norm).weight)
        if isinstance(mlp, SparseMoE):
            for name, (view, split) in expert_slots(p, mlp).items():
                slots[name] = WeightSlot(view, 0, view.shape[0], split)
            continue
        inter = arch.intermediate_size
        if fused:
            whole(f"{p}mlp.gate_up_proj.weight", mlp.gate_up_proj.weight)
        else:
            slots[f"{p}mlp.gate_proj.weight"] = WeightSlot(mlp.gate_up_proj.weight, 0, inter, 0)
            slots[f"{p}mlp.up_proj.weight"] = WeightSlot(mlp.gate_up_proj.weight, inter, inter,
                                                         0)
        whole(f"{p}mlp.down_proj.weight", mlp.down_proj.weight, split=1)
    return slots


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: those the index names (each inside the folder: a name like
    ../../etc/passwd is refused, never opened), else every *.safetensors file."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightLoadError(f"{index} is not a safetensors index ({type(exc).__name__}: "
                                  f"{exc})") from None
        root = folder.resolve()
        files = []
        for name in names:
            path = (folder / str(name)).resolve()
            if not path.is_relative_to(root):
                raise WeightLoadError(f"{index} names {name!r}, outside the model folder")
            if not path.is_file():
                raise WeightLoadError(f"{index} names {name!r}, which is not in {folder}")
            files.append(path)
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {folder}")
    return files


@contextlib.contextmanager
def open_safetensors(path: Path):
    """safe_open, with a truncated or malformed file (at open or while its tensors are read)
    named in one WeightLoadError instead of a library traceback."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise WeightLoadError(f"{path} is not a readable safetensors file: {exc}") from None


@torch.no_grad()
def load_weights(model: DecoderForCausalLM, folder: str | Path,
                 substitute: dict[str, torch.Tensor] | None = None,
                 shard: Shard = Shard()) -> None:
    """substitute: tensors by name filled in place of the checkpoint's (a compressed-tensors
    checkpoint's projections dequantized: engine/models/compressed.py), whose compressed
    parts (weight_packed, weight_scale, ...) are then not unexpected. shard: a tensor-
    parallel rank's place; the model is then that rank's (parallel.local_arch) and each split
    tensor is narrowed to the rank's share before the shape check."""
    folder = Path(folder)
    slots = checkpoint_slots(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    mis_shaped: list[str] = []
    substitute = substitute or {}
    prefixes = {name.rpartition(".")[0] for name in substitute}

    def put(name: str, tensor) -> None:
        slot = slots.get(name)
        if slot is not None and slot.param.is_meta:
            return  # an expert left for its blocks (build_model's experts_later)
        if slot is None:
            unexpected.append(name)
            return
        if shard.size > 1 and slot.split == SUMMED:
            tensor = tensor if shard.rank == 0 else torch.zeros_like(tensor)
        elif shard.size > 1 and slot.split is not None and slot.split < tensor.dim():
            tensor = shard.narrow(tensor, slot.split)
        expected = (slot.rows, *slot.param.shape[1:])
        if tuple(tensor.shape) != expected:
            mis_shaped.append(f"{name}: checkpoint {tuple(tensor.shape)}, model {expected}")
            return
        slot.param[slot.start:slot.start + slot.rows].copy_(tensor)
        loaded.add(name)

    later = any(slot.param.is_meta for slot in slots.values())
    for name, tensor in substitute.items():
        put(name, tensor)
    family = FAMILIES[model.arch.family]
    for path in safetensors_files(folder):
        with open_safetensors(path) as f:
            for stored in f.keys():
                name = family.checkpoint_name(stored)
                if name is None or name.endswith(_IGNORED_SUFFIXES) or name in substitute:
                    continue
                if name.rpartition(".")[0] in prefixes:
                    continue  # a substituted weight's compressed parts
                if name == "lm_head.weight" and model.arch.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                if family.checkpoint_split is not None and name not in slots:
                    parts = family.checkpoint_split(name, f.get_tensor(stored))
                    if parts is not None:
                        for part, tensor in parts:
                            put(part, tensor)
                        continue
                if name not in slots:
                    if later and is_stacked(name):
                        continue  # left for its blocks, not read
                    parts = split_stacked(name, f.get_tensor(stored))
                    if parts is None:
                        unexpected.append(name)
                    for part, tensor in parts or ():
                        put(part, tensor)
                    continue
                put(name, f.get_tensor(stored))
    later = {name for name, slot in slots.items() if slot.param.is_meta}
    missing = sorted(set(slots) - loaded - later - {s.split(':')[0] for s in mis_shaped})
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected[:8]}"
                        f"{' ...' if len(unexpected) > 8 else ''}")
    if mis_shaped:
        problems.append(f"mis-shaped tensors: {mis_shaped[:8]}")
    if problems:
        raise WeightLoadError(f"cannot load {folder}: " + "; ".join(problems))
    offset = model.arch.variant.norm_offset
    if offset:  # each norm scales by offset + weight: folded in once (family.py)
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(offset)


@torch.no_grad()
def init_dummy_weights(model: DecoderForCausalLM, seed: int = 0) -> None:
    """Random weights from the config alone (benchmarks of large shapes), drawn on the
    parameters' device: an 8B model's 8e9 normal draws on the host took most of a minute."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.copy_(torch.randn(param.shape, generator=generators[param.device],
                                device=param.device) * 0.02)


def build_model(arch: ModelArch, folder: str | Path | None, dtype: torch.dtype,
                device: torch.device, max_positions: int, dummy: bool = False,
                seed: int = 0, substitute: dict[str, torch.Tensor] | None = None,
                shard: Shard = Shard(), experts_later: bool = False) -> DecoderForCausalLM:
    """Built on the meta device (no memory, no random init), then each parameter allocated
    once, on the target device in the target dtype, and filled from the checkpoint one tensor
    at a time (cast and copied as it is read from its shard). Host memory peaks near the
    weights in the target dtype (on the CPU) plus the largest tensor, instead of an fp32 copy
    of the whole model plus its cast (bench/loading.py measures it). experts_later: a mixture's
    expert weights are not allocated nor read (a GGUF file's blocks replace them after:
    a 30B-A3B file would otherwise take its dense size in memory at load)."""
    with torch.device("meta"):
        model = DecoderForCausalLM(arch, max_positions)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if experts_later and isinstance(module, SparseMoE) and name in EXPERT_PARAMS:
                continue  # left on meta: the blocks take their place (SparseMoE.load_quantized)
            setattr(module, name, nn.Parameter(
                torch.empty(param.shape, dtype=dtype, device=device), requires_grad=False))
    model.ropes = nn.ModuleList(  # the fp32 cos/sin tables
        RotaryEmbedding(r, arch.head_dim, max_positions).to(device) for r in arch.variant.ropes)
    if dummy:
        init_dummy_weights(model, seed)
    else:
        load_weights(model, folder, substitute, shard)
    return model.eval()
