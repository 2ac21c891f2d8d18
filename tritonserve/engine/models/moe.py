"""The mixture-of-experts MLP: a router picks each token's top-k experts, and only they run.

Routing (`route`) is transformers': the router's logits, softmax in fp32 over every expert,
torch.topk (its tie order), the chosen weights renormalised where the family says. The logits
come from fp32 panels on the CPU (kernels/cpu/panels_fp32.h sums each row in one order at any
batch of two or more rows; a lone row is given a twin), so a token picks the same experts with
the same weights in a batch as alone.

The experts' weights are stacked, one tensor a projection: gate_up [E, 2I, H] (each expert's
gate rows, then its up rows) and down [E, H, I], in any form of engine/models/linear.py once
packed (each expert packed alone, then stacked: a stacked tensor's [e] is that expert's
packed weight). `moe_experts` (a CustomOp: one implementation a device) runs them: rows
grouped by expert across the batch, each chosen expert's weights read once a step, none of the
others (kernels/cpu/moe.cpp on the CPU, kernels/triton/fused_moe.py on CUDA, kernels/
reference.py's fused_moe the oracle).

Checkpoints name experts one tensor each (model.layers.L.mlp.experts.E.gate_proj.weight);
`split_stacked` also reads them stacked (a GGUF file's ffn_gate_exps, as gguf_convert names
it, and transformers' fused gate_up_proj [E, 2I, H]).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from tritonserve.kernels import cpu, quant_layout, reference

from . import ops
from .family import Experts
from .linear import linear, pack, weight_form

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# a WeightSlot split for a bias added before a row-parallel all-reduce (gpt-oss's o and
# expert down biases): under tensor parallelism rank 0 holds it and the others zeros, so the
# sum over ranks adds it once (engine/models/loader.py)
SUMMED = -1
EXPERT_PARAMS = ("gate_up", "down")  # SparseMoE's stacked expert weights


def route(logits: torch.Tensor, top_k: int, normalize: bool, softmax_last: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (expert ids [T, k] int64, weights [T, k] fp32), as transformers'
    TopKRouter: softmax over all experts in fp32, top-k, renormalised if `normalize`;
    softmax_last (gpt-oss's router): top-k of the logits, then a softmax over those k."""
    if softmax_last:
        top, ids = torch.topk(logits, top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1, dtype=torch.float32)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


class MoeExperts(ops.CustomOp):
    """x [T, H], each token's expert ids and routing weights [T, k], the stacked experts
    gate_up [E, ...] and down [E, ...] (expert e is [e], in any form of linear.py), inter I,
    and gpt-oss's extras (fp32 biases gate_up_bias [E, 2I] and down_bias [E, H], or None;
    swiglu_limit > 0: its clamped SwiGLU with swiglu_alpha) -> [T, H], reference.fused_moe's
    sum. On the CPU the C++ op (kernels/cpu/moe.cpp) groups the rows by expert and reads each
    chosen expert once; a compiled graph calls it as it is (its fake: kernels/cpu OPS).
    Without it, and for the forms the Triton kernel does not take, `grouped_experts`."""

    def __call__(self, x, ids, weights, gate_up, down, inter, gate_up_bias=None,
                 down_bias=None, swiglu_limit=0.0, swiglu_alpha=1.702):
        args = (x, ids, weights, gate_up, down, inter, gate_up_bias, down_bias, swiglu_limit,
                swiglu_alpha)
        if x.device.type == "cpu":
            return self.forward_cpu(*args)
        return super().__call__(*args)

    def forward_native(self, *args):
        return grouped_experts(*args)

    def forward_cpu(self, x, ids, weights, gate_up, down, inter, *extras):
        if not cpu.LOADED:  # set once the engine loaded the library (a graph reads the flag)
            return self.forward_native(x, ids, weights, gate_up, down, inter, *extras)
        return torch.ops.tritonserve.moe_experts(x.contiguous(), ids, weights.float(),
                                                 gate_up, down, inter, *extras)

    def forward_cuda(self, x, ids, weights, gate_up, down, inter, *extras):
        from tritonserve.kernels.triton import fused_moe
        if not fused_moe.takes(gate_up, down):
            return self.forward_native(x, ids, weights, gate_up, down, inter, *extras)
        return fused_moe.fused_moe(x, ids, weights, gate_up, down, inter, *extras)


def grouped_experts(x, ids, weights, gate_up, down, inter, gate_up_bias=None, down_bias=None,
                    swiglu_limit=0.0, swiglu_alpha=1.702):
    """MoeExperts in torch over any weight form: the tokens sorted by expert, one matmul pair
    for each expert chosen (linear.py's `linear`), the weighted rows summed in fp32."""
    hidden = x.shape[1]
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token, w = order // ids.shape[1], weights.reshape(-1)[order].float()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token[start:start + n]
        h = linear(x[rows].contiguous(), gate_up[e], out_features=2 * inter)
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].to(h.dtype)
        a = (reference.swiglu_clamped(h, swiglu_limit, swiglu_alpha) if swiglu_limit > 0
             else ops.silu_and_mul(h))
        y = linear(a.contiguous(), down[e], out_features=hidden)
        if down_bias is not None:
            y = y + down_bias[e].to(y.dtype)
        out.index_add_(0, rows, y.float() * w[start:start + n].unsqueeze(1))
        start += n
    return out.to(x.dtype)


moe_experts = MoeExperts()


class Router(nn.Module):
    """The router's weight [E, H] (the checkpoint's mlp.gate.weight) and, for gpt-oss, its
    bias [E]; its logits in fp32."""

    def __init__(self, hidden: int, experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.bias = nn.Parameter(torch.empty(experts)) if bias else None
        self.count = experts
        self.panels: torch.Tensor | None = None  # fp32 panels, set by prepack

    def prepack(self) -> None:
        """fp32 panels of the weight where the C++ library has them (one summation order at
        every batch size: the same experts in a batch as alone)."""
        if self.panels is None and self.weight.device.type == "cpu":
            try:
                self.panels = pack(self.weight.detach().float(), "panels", 1)
            except ValueError:  # no C++ library: F.linear in fp32
                self.panels = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            rows = x.shape[0]
            x = x.float()
            if rows == 1:  # one row takes panels_fp32.h's two-chain path (another order)
                x = torch.cat((x, x))
            bias = None if self.bias is None else self.bias.float()
            return torch.ops.tritonserve.packed_linear(x.contiguous(), self.panels,
                                                       self.count, bias)[:rows]
        return torch.nn.functional.linear(x.float(), self.weight.float(),
                                          None if self.bias is None else self.bias.float())


class SparseMoE(nn.Module):
    """x [T, H] -> sum over each token's top-k experts of weight * expert(x), an expert being
    down(silu(gate(x)) * up(x)) (gpt-oss: with biases, its clamped SwiGLU: Experts). reduce:
    as Linear.reduce (tensor parallel: each rank holds every expert's share of the
    intermediate rows)."""

    reduce = None

    def __init__(self, hidden: int, spec: Experts, activation: str) -> None:
        super().__init__()
        if activation != "silu":
            raise ValueError(f"mixture of experts with a {activation} activation is not "
                             f"supported (silu only)")
        self.spec, self.hidden = spec, hidden
        self.inter = spec.intermediate
        self.gate = Router(hidden, spec.count, spec.bias)
        self.gate_up = nn.Parameter(torch.empty(spec.count, 2 * self.inter, hidden))
        self.down = nn.Parameter(torch.empty(spec.count, hidden, self.inter))
        # gpt-oss: each expert's gate/up and down biases, kept in fp32 (SparseMoE.pack)
        self.gate_up_bias = (nn.Parameter(torch.empty(spec.count, 2 * self.inter))
                             if spec.bias else None)
        self.down_bias = nn.Parameter(torch.empty(spec.count, hidden)) if spec.bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        ids, weights = route(self.gate(x), spec.top_k, spec.normalize, spec.softmax_last)
        if spec.plain:
            y = moe_experts(x, ids, weights, self.gate_up, self.down, self.inter)
        else:
            y = moe_experts(x, ids, weights, self.gate_up, self.down, self.inter,
                            self.gate_up_bias, self.down_bias, spec.swiglu_limit or 0.0,
                            spec.swiglu_alpha)
        if self.reduce is not None:
            self.reduce(y)
        return y

    def pack(self, form: str, batch_hint: int) -> None:
        """Each expert's plain weights in `form` (panels, onednn needs one tensor: kept
        plain), stacked again; the biases in fp32, as the expert ops add them."""
        self.gate.prepack()
        for name in ("gate_up_bias", "down_bias"):
            bias = getattr(self, name)
            if bias is not None and bias.dtype != torch.float32:
                setattr(self, name, nn.Parameter(bias.detach().float(), requires_grad=False))
        if form != "panels" or weight_form(self.gate_up[0]) != "plain":
            return
        for name in ("gate_up", "down"):
            stacked = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.stack(
                [pack(w, "panels", batch_hint) for w in stacked.detach()]),
                requires_grad=False))

    def quantize(self, kind: str, group: int) -> None:
        """Each expert quantized into `kind` (decoder.quantize_weights), where rows allow."""
        if weight_form(self.gate_up[0]) != "plain" or self.hidden % group or self.inter % group:
            return
        for name in ("gate_up", "down"):
            stacked = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.stack(
                [quant_layout.quantize(w, kind, group) for w in stacked.detach()]).to(
                stacked.device), requires_grad=False))

    def load_quantized(self, gate_up: torch.Tensor | None, down: torch.Tensor) -> None:
        """The experts as a GGUF file's blocks, packed and stacked [E, ...]
        (gguf.fuse_expert_rows: each expert's gate and up rows in one matmul); gate_up None:
        they do not stack, the dense experts stay (refused where none were loaded)."""
        if gate_up is None:
            if self.gate_up.is_meta:  # build_model left them for these blocks
                raise ValueError("the experts' gate and up blocks do not stack into whole "
                                 "panels and no dense experts were loaded")
            return
        device = self.gate.weight.device  # the experts' own may be meta (build_model)
        self.gate_up = nn.Parameter(gate_up.to(device), requires_grad=False)
        self.down = nn.Parameter(down.to(device), requires_grad=False)

    def expert_bytes(self) -> int:
        """The bytes one expert's weights occupy (gate_up and down, as stored)."""
        return sum(t[0].numel() * t.element_size() for t in (self.gate_up, self.down))


def expert_slots(prefix: str, moe: SparseMoE, rows_split: bool = True) -> dict:
    """Checkpoint name -> (tensor view, split) for every expert of a layer (loader.py makes
    WeightSlots of them): gate rows [0, I) and up rows [I, 2I) of gate_up[e], down[e]."""
    inter = moe.inter
    slots = {f"{prefix}mlp.gate.weight": (moe.gate.weight, None)}
    if moe.gate.bias is not None:
        slots[f"{prefix}mlp.gate.bias"] = (moe.gate.bias, None)
    for e in range(moe.spec.count):
        p = f"{prefix}mlp.experts.{e}."
        slots[f"{p}gate_proj.weight"] = (moe.gate_up.data[e, :inter], 0)
        slots[f"{p}up_proj.weight"] = (moe.gate_up.data[e, inter:], 0)
        slots[f"{p}down_proj.weight"] = (moe.down.data[e], 1)
        if moe.gate_up_bias is not None:
            slots[f"{p}gate_proj.bias"] = (moe.gate_up_bias.data[e, :inter], 0)
            slots[f"{p}up_proj.bias"] = (moe.gate_up_bias.data[e, inter:], 0)
            slots[f"{p}down_proj.bias"] = (moe.down_bias.data[e], SUMMED)
    return slots


_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj|gate_up_proj)"
                      r"(\.weight)?$")


# a stacked expert bias [E, rows] (gpt-oss's, as gguf_convert names a GGUF file's
# ffn_*_exps.bias): each expert's own
_STACKED_BIAS = re.compile(r"(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.bias$")


def is_stacked(name: str) -> bool:
    return _STACKED.fullmatch(name) is not None


def split_stacked(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """A stacked expert tensor [E, rows, K] -> its per-expert names and tensors (None: not
    one). gate_up_proj [E, 2I, H] (transformers' fused form) gives each expert's gate and up;
    a stacked bias [E, rows] each expert's bias."""
    bias = _STACKED_BIAS.fullmatch(name)
    if bias is not None and tensor.dim() == 2:
        return [(f"{bias.group(1)}.{e}.{bias.group(2)}.bias", tensor[e])
                for e in range(tensor.shape[0])]
    found = _STACKED.fullmatch(name)
    if found is None or tensor.dim() != 3:
        return None
    base, proj = found.group(1), found.group(2)
    out = []
    for e in range(tensor.shape[0]):
        if proj == "gate_up_proj":
            gate, up = tensor[e].chunk(2, dim=0)
            out += [(f"{base}.{e}.gate_proj.weight", gate), (f"{base}.{e}.up_proj.weight", up)]
        else:
            out.append((f"{base}.{e}.{proj}.weight", tensor[e]))
    return out


def stacked_name(layer: int, proj: str) -> str:
    """The name a stacked projection of layer `layer` goes by (gguf_convert writes it)."""
    return f"model.layers.{layer}.mlp.experts.{proj}.weight"


def fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked gate / up / down tensors (stacked_name) -> transformers 5's own parameters,
    model.layers.L.mlp.experts.gate_up_proj [E, 2I, H] and .down_proj [E, H, I], which every
    family's model there loads as they are (its per-expert names differ by family: Mixtral's
    w1 / w2 / w3); split_stacked reads them back."""
    out = {}
    for name, tensor in state.items():
        found = _STACKED.fullmatch(name)
        if found is None or found.group(2) == "up_proj":
            if found is None:
                out[name] = tensor
            continue
        base = found.group(1)
        if found.group(2) == "gate_proj":
            out[f"{base}.gate_up_proj"] = torch.cat(
                (tensor, state[f"{base}.up_proj.weight"]), dim=1).contiguous()
        else:
            out[f"{base}.down_proj"] = tensor
    return out
