"""llama.cpp's GGUF LoRA files, read into the pairs engine/lora.py builds an adapter from.

convert_lora_to_gguf.py writes `general.type = adapter`, `adapter.type = lora`,
`adapter.lora.alpha` and, per adapted projection, the base tensor's name with `.lora_a`
(A [r, in]) and `.lora_b` (B [out, r]), each through the base family's converter: for the
families whose q and k rows llama.cpp permutes for its interleaved rope, B's rows are permuted
as the base weight's are, and are put back here as engine/models/gguf.py puts the base's back.
llama.cpp scales by alpha / r (no rsLoRA in the file; alpha 0 means a scale of 1), and so does
this reader. Tensors in F32, F16, BF16 or Q8_0 (the converter's outtypes) are dequantized to
fp32: an adapter's products are small beside the base's.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from .errors import InvalidRequestError
from .models.arch import ModelArch
from .models.family import FAMILIES
from .models.gguf import unpermute_rows

_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


def is_gguf(path: Path) -> bool:
    """A file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf_adapter(name: str, path: Path, arch: ModelArch
                      ) -> tuple[int, float, dict[tuple[int, str], dict[str, torch.Tensor]]]:
    """(rank, scale, {(layer, PEFT module): {"A": [r, in], "B": [out, r]}}) of a GGUF LoRA
    file for this base; InvalidRequestError naming what does not fit."""
    import gguf

    def fail(problem: str):
        raise InvalidRequestError("lora_modules", f"adapter {name!r}: {problem}")

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        fail(f"not a GGUF file ({exc})")
    if _field(reader, gguf.Keys.General.TYPE) != gguf.GGUFType.ADAPTER or \
            _field(reader, gguf.Keys.Adapter.TYPE) != "lora":
        fail("a GGUF file that is not a LoRA adapter (general.type adapter, adapter.type "
             "lora, as llama.cpp's convert_lora_to_gguf.py writes)")
    family = FAMILIES[arch.family]
    file_arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    if file_arch not in family.gguf_archs:
        fail(f"written for a {file_arch!r} base; this server's is {arch.family} "
             f"({', '.join(family.gguf_archs) or 'no GGUF architecture'}): another base model?")
    modules = {block: hf.rsplit(".", 1)[-1] for block, hf in family.gguf_names.items()
               if ".experts." not in hf}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        found = _KEY.fullmatch(tensor.name)
        module = modules.get(found.group(2)) if found else None
        if module is None:
            fail(f"{tensor.name} is not a projection's lora_a / lora_b this server adapts")
        layer, which = int(found.group(1)), found.group(3).upper()
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            fail(f"{tensor.name} is {tensor.tensor_type.name} (F32, F16, BF16, Q8_0 read)")
        t = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
            [int(s) for s in reversed(tensor.shape)])  # GGUF lists the row length first
        if which == "B" and family.gguf_rope_permuted and module in ("q_proj", "k_proj"):
            t = unpermute_rows(t, arch.num_heads if module == "q_proj" else arch.num_kv_heads)
        pairs.setdefault((layer, module), {})[which] = t
    ranks = {pair["A"].shape[0] for pair in pairs.values() if "A" in pair}
    if len(ranks) != 1:
        fail(f"one rank for every projection expected, found {sorted(ranks) or 'none'}")
    rank = ranks.pop()
    alpha = float(_field(reader, gguf.Keys.Adapter.LORA_ALPHA) or 0.0)
    return rank, alpha / rank if alpha else 1.0, pairs
