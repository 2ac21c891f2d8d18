"""The model's architecture, read from a Hugging Face config.json into one typed record: the
shapes, and the variant its family (engine/models/family.py) reads from the config."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...kernels.reference import KV_SCALE_BYTES
from .family import DecoderVariant, family_for


@dataclass(frozen=True)
class ModelArch:
    """The decoder's shapes and its family's variant (engine/models/family.py)."""

    architecture: str
    family: str
    variant: DecoderVariant
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None = None  # the checkpoint's dtype, as config.json names it

    @property
    def tie_word_embeddings(self) -> bool:
        return self.variant.tied_head

    @property
    def qkv_bias(self) -> bool:
        return self.variant.qkv_bias

    @property
    def qk_norm(self) -> bool:
        return self.variant.qk_norm is not None

    @property
    def rope_theta(self) -> float:
        """The first rope table's base (every layer's, but for a family with several)."""
        return self.variant.ropes[0].theta

    @property
    def sliding_window(self) -> int | None:
        """The widest attention window of any layer (None: every layer sees everything)."""
        return self.variant.widest_window

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelArch":
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        eos = config.get("eos_token_id")
        gen_path = folder / "generation_config.json"
        if gen_path.exists():
            eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
        return cls.from_dict(config, eos)

    @classmethod
    def from_dict(cls, config: dict, eos: int | list[int] | None = None) -> "ModelArch":
        """The arch of a config.json; a field the family needs and the config lacks is one
        ValueError naming it."""
        try:
            return cls._from_dict(config, eos)
        except KeyError as exc:
            named = ", ".join(config.get("architectures") or ()) or config.get("model_type")
            raise ValueError(f"{named}: config.json has no {exc.args[0]!r}") from None

    @classmethod
    def _from_dict(cls, config: dict, eos: int | list[int] | None) -> "ModelArch":
        family = family_for(config)
        if isinstance(config.get("text_config"), dict):  # a multimodal checkpoint's text tower
            config = {**config["text_config"], "architectures": config.get("architectures"),
                      **({"eos_token_id": config["eos_token_id"]}
                         if "eos_token_id" in config else {})}
        arch = next((a for a in config.get("architectures") or ()
                     if a in family.architectures), family.architectures[0])
        variant = family.variant(config)
        num_heads = config["num_attention_heads"]
        eos = config.get("eos_token_id") if eos is None else eos
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            family=family.name,
            variant=variant,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            eos_token_ids=eos_ids,
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
        )

    def mlp_params(self, active: bool = False) -> int:
        """Every layer's MLP weights; active: those one token reads (top_k of a mixture's
        experts, and its router)."""
        h, experts = self.hidden_size, self.variant.experts
        total = 0
        for layer in range(self.num_layers):
            if experts is not None and experts.sparse(layer):
                count = experts.top_k if active else experts.count
                total += count * 3 * h * experts.intermediate + experts.count * h
            else:
                total += 3 * h * self.intermediate_size
        return total

    @property
    def expert_params(self) -> int:
        """The mixture's expert weights, all of them (0 for a dense model)."""
        return self.mlp_params() - self.mlp_params(active=True) if self.variant.experts else 0

    @property
    def num_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + 2 * h) + self.mlp_params() + embed + h

    def flops_per_token(self) -> float:
        """Matmul FLOPs of one output token: 2 x (the layers' weights it reads, a mixture's
        chosen experts only, + the lm_head), the embedding lookup being a gather, not a
        matmul; attention over the context excluded."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        return 2.0 * (self.num_layers * attn + self.mlp_params(active=True)
                      + self.vocab_size * h)

    def kv_row(self, dtype: torch.dtype) -> int:
        """Elements of one (token, KV head) cache row: an int8 cache's rows carry their fp32
        scale after the codes (kernels/reference.py's quantize_kv)."""
        return self.head_dim + (KV_SCALE_BYTES if dtype == torch.int8 else 0)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = 1 if dtype == torch.int8 else torch.finfo(dtype).bits // 8
        return 2 * self.num_layers * self.num_kv_heads * self.kv_row(dtype) * elem

