"""Model families (engine/models/family.py, one file each in families/): the registry, each
shipped family's variant, the variant's checks, the GGUF q/k row order per family, and
docs/howto/add-a-model-family.md walked on a made-up family in a copy of the package."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tritonserve
from tritonserve.engine.config import EngineConfig
from tritonserve.engine.models import FAMILIES, ModelArch, family_for
from tritonserve.engine.models import gguf as gguf_weights
from tritonserve.engine.models.family import DecoderVariant, Rope, variant_from
from tritonserve.engine.plan import layers_refusal

from .tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
BASE = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 2}


def test_every_file_in_families_is_a_registered_family():
    files = {p.stem for p in (ROOT / "tritonserve/engine/models/families").glob("*.py")
             if p.stem != "__init__"}
    assert files == {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "granite", "olmo2",
                     "smollm3", "qwen3_moe", "mixtral", "olmoe", "gpt_oss"}
    assert set(FAMILIES) == files
    for family in FAMILIES.values():
        for arch in family.architectures:
            assert family_for({"architectures": [arch]}) is family
        for model_type in family.model_types:  # a config without `architectures`
            assert family_for({"model_type": model_type}) is family


def test_the_shipped_variants_are_what_each_family_differs_in():
    def variant(arch, **extra):
        return ModelArch.from_dict({**BASE, "architectures": [arch], **extra}).variant

    assert variant("LlamaForCausalLM") == DecoderVariant()
    assert variant("LlamaForCausalLM", tie_word_embeddings=True) == DecoderVariant(
        tied_head=True)
    assert variant("Qwen2ForCausalLM") == DecoderVariant(qkv_bias=True)
    assert variant("Qwen3ForCausalLM") == DecoderVariant(qk_norm="head")
    assert variant("MistralForCausalLM", sliding_window=64).windows == (64, 64, 64)
    # Qwen2's window: only with use_sliding_window, from max_window_layers on
    windows = variant("Qwen2ForCausalLM", sliding_window=32, use_sliding_window=True,
                      max_window_layers=1).windows
    assert windows == (None, 32, 32)
    assert variant("Qwen2ForCausalLM", sliding_window=32).windows == ()


def test_an_unknown_family_or_variant_value_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^GPT2LMHeadModel is not supported \(supported: "
                                         r"Gemma3ForCausalLM.*LlamaForCausalLM"):
        ModelArch.from_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported"):
        ModelArch.from_dict({**BASE, "architectures": ["LlamaForCausalLM"],
                             "hidden_act": "relu"})
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported; supported: "
                                         "default, llama3, linear, yarn, longrope, dynamic"):
        ModelArch.from_dict({**BASE, "architectures": ["LlamaForCausalLM"],
                             "rope_scaling": {"rope_type": "mrope", "factor": 4.0}})
    with pytest.raises(ValueError, match="norm_placement 'middle' is not supported"):
        variant_from(BASE, norm_placement="middle")


def test_the_layers_op_check_is_read_from_the_variant():
    """plan.layers_refusal names each way a variant differs from Llama's layer."""
    config = EngineConfig(model="x", dtype="float32")
    llama = ModelArch.from_dict({**BASE, "architectures": ["LlamaForCausalLM"]})
    assert llama.variant.layers_op_refusal() is None
    odd = dict(norm_placement="sandwich", activation="gelu_tanh",
               ropes=(Rope(1e4), Rope(1e6, fraction=0.5)), layer_ropes=(0, 1, None),
               attn_softcap=50.0, residual_scale=0.5, embedding_scale=2.0)
    variant = variant_from(BASE, **odd)
    assert variant.layers_op_refusal() == (
        "sandwich norms, gelu_tanh activation, a rope table per layer, layers without rope, "
        "partial rotary, an attention soft-cap, a residual multiplier, an embedding scale")
    import dataclasses
    arch = dataclasses.replace(llama, variant=variant)
    assert layers_refusal(config, arch, library=True).endswith(variant.layers_op_refusal())


def _q8_rows(rows: int, k: int) -> np.ndarray:
    """Q8_0 blocks whose row r holds the value r at every position (d = 1.0)."""
    block = np.zeros((rows, k // 32, 34), dtype=np.uint8)
    block[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    block[:, :, 2:] = np.arange(rows, dtype=np.int8).view(np.uint8)[:, None, None]
    return block.reshape(rows, -1)


@pytest.mark.parametrize("family, permuted", [("llama", True), ("qwen2", False)])
def test_gguf_q_rows_are_put_back_only_where_the_family_converter_permuted_them(
        tmp_path, family, permuted):
    """llama.cpp's llama converter permutes q and k rows for its interleaved rope; its qwen2
    converter keeps NeoX order, so a Qwen2 file's rows are read as stored."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(str(path), family)
    raw = _q8_rows(16, 32)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_shape=raw.shape,
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    served = gguf_weights.read_quantized(path, 2, 1, family=family)
    from tritonserve.kernels import quant_layout
    weight = quant_layout.dequantize(served["model.layers.0.self_attn.q_proj.weight"].packed,
                                     16)
    rows = weight[:, 0].round().int().tolist()
    expected = gguf_weights.unpermute_rows(torch.arange(16), 2).tolist() if permuted \
        else list(range(16))
    assert rows == expected


HOWTO = ROOT / "docs/howto/add-a-model-family.md"

# The made-up family's forward, written out in torch (fp32): each sublayer's output normed
# before the residual add; the engine's generic decoder must agree with it.
REFERENCE = """
import json, sys, torch
from safetensors.torch import load_file
folder, prompt = sys.argv[1], json.loads(sys.argv[2])
cfg = json.load(open(f"{folder}/config.json")); w = load_file(f"{folder}/model.safetensors")
H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
d, eps = H // nh, cfg["rms_norm_eps"]
def norm(x, name): return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[name]
def rope(x, pos):
    inv = 1.0 / (cfg.get("rope_theta", 10000.0) ** (torch.arange(0, d, 2).float() / d))
    f = torch.outer(pos.float(), inv); emb = torch.cat((f, f), -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin
def logits(ids):
    T = len(ids); pos = torch.arange(T); x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, d)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, d)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, d)
        q, k = rope(q, pos), rope(k, pos)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        att = att.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(T, H)
        x = x + norm(o @ w[p + "self_attn.o_proj.weight"].T, p + "post_attention_layernorm.weight")
        g, u = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        m = (torch.nn.functional.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
        x = x + norm(m, p + "post_feedforward_layernorm.weight")
    return norm(x, "model.norm.weight") @ w["lm_head.weight"].T
ids = list(prompt)
for _ in range(8):
    ids.append(int(logits(torch.tensor(ids))[-1].argmax()))
print(json.dumps(ids[len(prompt):]))
"""

ENGINE = """
import json, sys
from tritonserve.engine import LLM, SamplingParams
from tritonserve.engine.models import FAMILIES
llm = LLM(sys.argv[1], dtype="float32")
out = llm.generate([json.loads(sys.argv[2])],
                   SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
print(json.dumps({"families": sorted(FAMILIES), "plan": llm.engine.runner.plan.describe(),
                  "tokens": list(out.token_ids)}))
"""


def _post_llama_checkpoint(folder: Path) -> Path:
    """A tiny Llama checkpoint relabelled as the made-up family: its two norms a layer renamed
    to the post placement's and set to random weights (so a norm in the wrong place shows)."""
    from safetensors.torch import load_file, save_file
    write_tiny_model(folder, tie_word_embeddings=False)
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {}
    gen = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        name = name.replace("post_attention_layernorm", "post_feedforward_layernorm")
        name = name.replace("input_layernorm", "post_attention_layernorm")
        if "layernorm" in name:
            tensor = 0.5 + torch.rand(tensor.shape, generator=gen)
        renamed[name] = tensor.contiguous()
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["PostLlamaForCausalLM"], model_type="post_llama")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.slow
def test_the_add_a_family_howto_serves_a_made_up_family_from_one_new_file(tmp_path):
    """The how-to's code block, written as the one new file in a copy of the package, serves
    a checkpoint of the made-up family: greedy tokens equal a plain-torch forward of its
    decoder, and the plan says why the C++ layers op does not take it."""
    blocks = re.findall(r"```python\n(.*?)```", HOWTO.read_text(), flags=re.S)
    assert len(blocks) == 1, "the how-to has one python block: the family's file"
    tree = tmp_path / "tree"
    shutil.copytree(Path(tritonserve.__file__).parent, tree / "tritonserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    families = tree / "tritonserve/engine/models/families"
    before = {p.name: p.read_bytes() for p in families.glob("*.py")}
    (families / "post_llama.py").write_text(blocks[0])
    assert {p.name: p.read_bytes() for p in families.glob("*.py") if p.name != "post_llama.py"
            } == before
    folder = _post_llama_checkpoint(tmp_path / "model")
    prompt = json.dumps([5, 17, 42, 99, 7, 3])
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # run from the copy: `python -c` puts the working folder first on sys.path
    ran = subprocess.run([sys.executable, "-c", ENGINE, str(folder), prompt], env=env,
                         cwd=tree, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    got = json.loads(ran.stdout.strip().splitlines()[-1])
    assert "post_llama" in got["families"]
    assert "layers" not in got["plan"].split(",")[0] or "post norms" in got["plan"]
    reference = subprocess.run([sys.executable, "-c", REFERENCE, str(folder), prompt],
                               cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert got["tokens"] == json.loads(reference.stdout)
    # the package itself does not know the made-up family
    assert "post_llama" not in FAMILIES
