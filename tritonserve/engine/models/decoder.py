"""The generic decoder over a flattened token batch: Llama's layer, with each way a family
differs read from its DecoderVariant (engine/models/family.py: norm placement, activation,
q/k norms, qkv and o biases, a rope table per layer or none, attention windows, scale,
soft-cap and sinks, residual, embedding and logit multipliers, tied head, logit soft-cap).

Projections are fused: one qkv matmul and one gate/up matmul per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tritonserve.kernels import cpu, quant_layout

from .. import huge_pages
from ..attention import AttentionBackend, AttentionMetadata
from . import ops
from .arch import ModelArch
from .gguf import fuse_expert_rows, fuse_rows
from .linear import Linear, linear, pack, weight_form
from .moe import SparseMoE
from .rope import RopeTables, RotaryEmbedding


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k_cache, v_cache
    backend: AttentionBackend
    lora: object | None = None  # the step's engine/lora.py LoraBatch; None: no adapter


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x -> normed x; with a residual: (normed residual + x, residual + x), fused."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        variant = arch.variant
        self.scale = variant.attention_scale or self.head_dim ** -0.5
        self.window = variant.window_of(layer_index)
        self.softcap = variant.attn_softcap
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=variant.o_bias)
        # gpt-oss: each query head's sink logit (family.py: DecoderVariant.sinks)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if variant.sinks else None
        self.qk_norm = variant.qk_norm  # None, "head" or "full" (family.py)
        if self.qk_norm:
            full = self.qk_norm == "full"
            self.q_norm = RMSNorm(self.q_size if full else self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size if full else self.head_dim, arch.rms_norm_eps)

    def forward(self, rope: RopeTables | None, x: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """rope: this layer's tables, None for a layer without rope."""
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        if ctx.lora is not None:
            ctx.lora.add(qkv, x, self.layer_index, "qkv")
        k_cache, v_cache = ctx.kv_caches[self.layer_index]
        masks = dict(window=self.window, softcap=self.softcap, sinks=self.sinks)
        whole = rope is not None and rope[0].shape[-1] == self.head_dim
        fused = ctx.backend.rope_store(qkv, k_cache) if whole and not self.qk_norm else None
        if fused is not None:  # rope, the split and the cache write in one op
            q = fused(qkv, *rope, ctx.meta.slot_mapping, k_cache, v_cache, self.num_heads)
            out = ctx.backend.attend(q, k_cache, v_cache, ctx.meta, self.scale, **masks)
            return self._out(out.reshape(-1, self.q_size), ctx)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = RotaryEmbedding.apply(q, rope), RotaryEmbedding.apply(k, rope)
        out = ctx.backend.forward(q, k.contiguous(), v.contiguous(), k_cache, v_cache,
                                  ctx.meta, self.scale, **masks)
        return self._out(out.reshape(-1, self.q_size), ctx)

    def _out(self, heads: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        y = self.o_proj(heads)
        if ctx.lora is not None:
            ctx.lora.add(y, heads, self.layer_index, "o")
        return y


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, layer_index: int = 0) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.intermediate_size = arch.intermediate_size
        self.activation = arch.variant.activation
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    @property
    def silu_in_matmul(self) -> bool:
        """gate/up carries the activation in its matmul's epilogue (Linear.fuse_silu)."""
        return self.gate_up_proj.silu_in_matmul

    def fuse_silu(self) -> bool:
        return self.activation == "silu" and self.gate_up_proj.fuse_silu()

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """lora: the step's LoraBatch (engine/lora.py), added before the activation (an
        engine with adapters never fuses silu into gate/up: LlmEngine checks it)."""
        h = self.gate_up_proj(x)
        if lora is not None:
            lora.add(h, x, self.layer_index, "gate_up")
        if self.silu_in_matmul:
            return self.down_proj(h)
        if self.activation == "silu":
            a = ops.silu_and_mul(h)
        else:
            gate, up = h.chunk(2, dim=-1)
            a = torch.nn.functional.gelu(gate, approximate="tanh") * up
        y = self.down_proj(a)
        if lora is not None:
            lora.add(y, a, self.layer_index, "down")
        return y


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_index: int) -> None:
        super().__init__()
        variant = arch.variant
        self.placement = variant.norm_placement
        self.rope_slot = variant.rope_of(layer_index)  # DecoderForCausalLM.ropes; None: none
        self.residual_scale = variant.residual_scale
        self.self_attn = Attention(arch, layer_index)
        experts = variant.experts
        self.mlp = (SparseMoE(arch.hidden_size, experts, variant.activation)
                    if experts is not None and experts.sparse(layer_index)
                    else MLP(arch, layer_index))
        self.norm_names = variant.norm_names()
        for name in self.norm_names:  # by the checkpoint's names (loader.py)
            setattr(self, name, RMSNorm(arch.hidden_size, arch.rms_norm_eps))

    def scaled(self, h: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as it joins the stream (Granite's residual multiplier)."""
        return h if self.residual_scale == 1.0 else h * self.residual_scale

    def forward(self, rope: RopeTables | None, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's last sublayer output, residual: the stream before it
        (None for the first layer, whose x is the embedding) -> this layer's (last sublayer
        output, residual); the stream after the layer is their sum."""
        if self.placement == "pre":  # the residual add fused into the norms
            if residual is None:
                residual, h = x, self.input_layernorm(x)
            else:
                h, residual = self.input_layernorm(x, residual)
            h = self.scaled(self.self_attn(rope, h, ctx))
            h, residual = self.post_attention_layernorm(h, residual)
            return self.scaled(self._mlp(h, ctx)), residual
        stream = x if residual is None else x + residual
        if self.placement == "post":
            h = self.post_attention_layernorm(self.self_attn(rope, stream, ctx))
            stream = stream + self.scaled(h)
            return self.scaled(self.post_feedforward_layernorm(self._mlp(stream, ctx))), stream
        h = self.self_attn(rope, self.input_layernorm(stream), ctx)  # sandwich
        stream = stream + self.scaled(self.post_attention_layernorm(h))
        h = self._mlp(self.pre_feedforward_layernorm(stream), ctx)
        return self.scaled(self.post_feedforward_layernorm(h)), stream

    def _mlp(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.mlp(h) if ctx.lora is None else self.mlp(h, ctx.lora)


class DecoderForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # the variant's rope tables; a layer's rope_slot indexes them (None: no rope). The
        # first is also self.rope, the one the layers op reads.
        self.ropes = nn.ModuleList(RotaryEmbedding(r, arch.head_dim, max_positions)
                                   for r in arch.variant.ropes)
        if not arch.tie_word_embeddings:
            self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.packed_tied_lm_head: torch.Tensor | None = None  # set by prepack_weights

    @property
    def rope(self) -> RotaryEmbedding:
        return self.ropes[0]

    def prepack_weights(self, form: str, batch_hint: int, fuse_silu: bool = True) -> None:
        """Every projection weight in `form` (the decode plan's weights: panels, onednn or
        plain; engine/models/linear.py) in place of the plain one; with panels and fuse_silu,
        bf16 gate/up with the activation in the matmul (Linear.fuse_silu; not where adapters
        add to gate and up: EngineConfig.serves_lora). A tied lm_head gets a packed
        copy of the embedding table, which stays plain for the lookup."""
        if form == "plain":
            return
        for module in self.modules():  # an MLP comes before its Linears
            if isinstance(module, MLP):
                if form == "panels" and fuse_silu:  # silu only (MLP.fuse_silu)
                    module.fuse_silu()
            elif isinstance(module, SparseMoE):
                module.pack(form, batch_hint)
            elif isinstance(module, Linear):
                module.pack(form, batch_hint)
        if self.arch.tie_word_embeddings and self.packed_tied_lm_head is None:
            self.packed_tied_lm_head = pack(self.embed_tokens.weight, form, batch_hint)

    @staticmethod
    def dense_mlp(layer: "DecoderLayer") -> tuple[Linear, ...]:
        """A layer's dense MLP projections (none for a mixture of experts)."""
        mlp = layer.mlp
        return () if isinstance(mlp, SparseMoE) else (mlp.gate_up_proj, mlp.down_proj)

    def quantize_weights(self, kind: str, group: int = quant_layout.GROUP) -> None:
        """Every projection quantized at load into `kind` (u4: int4, groups of `group`, scale
        and offset; s8: int8 per channel; kernels/quant_layout.py) where its row length is a
        multiple of the group; the lm_head in s8 either way (a 4-bit output layer costs the
        most accuracy: llama.cpp keeps it at Q6_K / Q8_0 too)."""
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.quantize(kind, group)
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                         *self.dense_mlp(layer)):
                if weight_form(proj.weight) == "plain" and proj.in_features % group == 0:
                    proj.weight = nn.Parameter(quant_layout.quantize(
                        proj.weight, kind, group).to(proj.weight.device), requires_grad=False)
        table = self.embed_tokens.weight
        if self.arch.hidden_size % 32 == 0:
            if self.arch.tie_word_embeddings:
                self.packed_tied_lm_head = quant_layout.quantize(table, "s8").to(table.device)
            else:
                self.lm_head.weight = nn.Parameter(quant_layout.quantize(
                    self.lm_head.weight, "s8").to(table.device), requires_grad=False)

    def load_quantized(self, tensors: dict) -> None:
        """The projections (and the lm_head) as quantized panels in place of the dense
        weights: tensors by Hugging Face name (engine/models/gguf.py's read_quantized). q, k, v
        and gate, up are stacked into the fused weights; a layer whose parts differ in kind
        keeps its dense weights. The embedding stays dense for the lookup."""
        device = self.embed_tokens.weight.device

        def use(proj: Linear, names: list[str], *fused: str) -> None:
            """the parts by `names`, else one fused tensor (Phi-3's attn_qkv, ffn_up)"""
            parts = [tensors.get(n) for n in names]
            if not all(p is not None for p in parts):
                parts = [tensors.get(n) for n in fused]
            if parts and all(p is not None for p in parts):
                packed = fuse_rows(parts)
                if packed is not None:
                    proj.weight = nn.Parameter(packed.to(device), requires_grad=False)

        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            use(attn.qkv_proj, [f"{p}self_attn.{x}_proj.weight" for x in "qkv"],
                f"{p}self_attn.qkv_proj.weight")
            use(attn.o_proj, [f"{p}self_attn.o_proj.weight"])
            if isinstance(mlp, SparseMoE):
                gate, up, down = (tensors.get(f"{p}mlp.experts.{x}.weight")
                                  for x in ("gate_proj", "up_proj", "down_proj"))
                if gate is not None and up is not None and down is not None:
                    mlp.load_quantized(fuse_expert_rows(gate, up), down.packed)
                continue
            use(mlp.gate_up_proj, [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"],
                f"{p}mlp.gate_up_proj.weight")
            use(mlp.down_proj, [f"{p}mlp.down_proj.weight"])
        if self.arch.tie_word_embeddings:
            head = tensors.get("model.embed_tokens.weight")
            if head is not None:
                self.packed_tied_lm_head = head.packed.to(device)
        else:
            use(self.lm_head, ["lm_head.weight"])

    def reduce_row_parallel(self, reduce) -> None:
        """o and down sum their partial products over the tensor-parallel ranks with
        `reduce` (engine/parallel.py); a bias of o / down (gpt-oss's) is added before the sum,
        so only rank 0 holds it (the loader's moe.SUMMED slots)."""
        for layer in self.layers:
            layer.self_attn.o_proj.reduce = reduce
            (layer.mlp if isinstance(layer.mlp, SparseMoE) else layer.mlp.down_proj).reduce = \
                reduce

    def gather_streamed_weights(self) -> None:
        """The packed weights a decode step streams (projections in panels or quantized
        panels, the packed tied lm_head) moved into one buffer on huge pages
        (engine/huge_pages.py); plain and oneDNN weights stay where they are."""
        owners = [(m, "weight") for m in self.modules()
                  if isinstance(m, Linear) and weight_form(m.weight) in ("panels", "quant")]
        owners += [(m, name) for m in self.modules() if isinstance(m, SparseMoE)
                   for name in ("gate_up", "down") if weight_form(getattr(m, name)[0]) in (
                       "panels", "quant")]
        head = self.packed_tied_lm_head
        if head is not None and weight_form(head) in ("panels", "quant"):
            owners.append((self, "packed_tied_lm_head"))
        views = huge_pages.gather([getattr(owner, name) for owner, name in owners])
        for (owner, name), view in zip(owners, views):
            setattr(owner, name, view if name == "packed_tied_lm_head"
                    else nn.Parameter(view, requires_grad=False))

    def decode_layers(self, block_size: int):
        """The C++ op that runs this model's whole layer stack for a decode step
        (kernels/cpu/decode_layers.cpp) with its weights, as a function of (input_ids,
        positions, ctx) -> hidden [T, hidden]. For a plan whose mode is layers (engine/plan.py
        checked that the op takes the model): every projection in panels or quantized panels,
        a bf16 dense gate/up with its activation in the matmul or (an engine serving
        adapters) every gate/up without; a model in another state is refused."""
        arch = self.arch
        dtype = self.embed_tokens.weight.dtype
        op = cpu.decode_layers(dtype, arch.head_dim, arch.num_heads // arch.num_kv_heads,
                               block_size)
        linears = [m for layer in self.layers for m in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)]
        fused = {layer.mlp.silu_in_matmul for layer in self.layers}
        if (op is None or arch.variant.layers_op_refusal() or len(fused) != 1
                or any(layer.mlp.silu_in_matmul and (dtype != torch.bfloat16 or weight_form(
                    layer.mlp.gate_up_proj.weight) != "panels") for layer in self.layers)
                or any(weight_form(lin.weight) not in ("panels", "quant") for lin in linears)):
            raise ValueError("decode_layers: the model is not in the layers plan's state "
                             "(C++ panels or quantized panels, silu in every bf16 dense "
                             "gate/up's matmul or in none, Llama's layer: "
                             "DecoderVariant.layers_op_refusal)")
        gate_up_silu = fused.pop()
        norms = [n.weight for layer in self.layers
                 for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        panels = [lin.weight for lin in linears]
        biases = [layer.self_attn.qkv_proj.bias for layer in self.layers] if arch.qkv_bias \
            else []
        head_scale = arch.variant.attention_scale or arch.head_dim ** -0.5
        # the op looks the step's rows up itself (the embedding, rope's tables in the
        # dtype: the values of lookup()) and ends with the final norm: three dispatched ops
        # fewer, ~45 us each in a batch-1 step
        table = self.embed_tokens.weight
        cos, sin = (t.to(dtype).unsqueeze(1) for t in (self.rope.cos, self.rope.sin))
        final_norm = self.norm.weight

        def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                    ctx: ForwardContext) -> torch.Tensor:
            meta = ctx.meta
            lora = () if ctx.lora is None else ctx.lora.layers_args(input_ids.shape[0],
                                                                    arch.num_layers)
            return op(table, norms, panels, biases, cos, sin, meta.slot_mapping,
                      [k for k, _ in ctx.kv_caches], [v for _, v in ctx.kv_caches],
                      meta.decode_block_tables, meta.decode_seq_lens, arch.num_heads,
                      arch.rms_norm_eps, head_scale, input_ids, positions, final_norm,
                      *lora, gate_up_silu=gate_up_silu)[0]

        return forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]"""
        x = self.embed_tokens(input_ids)
        variant = self.arch.variant
        if variant.embedding_scale != 1.0:  # in the dtype, as Gemma's reference scales
            x = x * torch.tensor(variant.embedding_scale, dtype=x.dtype)
        tables = [table.lookup(positions, x.dtype) for table in self.ropes]
        residual = None
        for layer in self.layers:
            x, residual = layer(None if layer.rope_slot is None else tables[layer.rope_slot],
                                x, residual, ctx)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab]"""
        if not self.arch.tie_word_embeddings:
            logits = self.lm_head(hidden)
        else:
            head = self.packed_tied_lm_head
            logits = linear(hidden, self.embed_tokens.weight if head is None else head,
                            out_features=self.arch.vocab_size)
        variant = self.arch.variant
        if variant.logit_scale != 1.0:
            logits = logits * variant.logit_scale
        cap = variant.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
