"""compressed-tensors W4A16 / W8A16 checkpoints (engine/models/compressed.py), written here by
the compressed-tensors library's own compressor from a tiny Llama: the codes land in the
packed layout as the library decompresses them, the engine serves them (token-identical to
transformers on the decompressed weights in fp32), and what is not served is refused naming
the field. Also int4 quantized at load in groups of 64 / 128."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tritonserve.engine import LLM, SamplingParams
from tritonserve.engine.models.compressed import CompressedError, read_compressed, scheme_of
from tritonserve.kernels import cpu, quant_layout
from tests.parity import TIE_GAP, assert_parity, hf_greedy
from tests.test_decode_layers import SHAPE
from tests.test_engine_parity import mixed_prompts
from tests.tiny_models import write_tiny_model

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.base import (  # noqa: E402
    PackedQuantizationCompressor)
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

needs_library = pytest.mark.skipif(cpu.op("packed_linear_quant") is None,
                                   reason="no C++ toolchain")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def compress(folder, target, preset: str, strategy: str = "group"):
    """The checkpoint with every projection compressed by compressed-tensors (pack-quantized,
    `preset`: W4A16, W4A16_ASYM, W8A16), config.json naming the scheme as llm-compressor
    writes it; returns (folder, the library's decompressed weights by name)."""
    shutil.copytree(folder, target)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if strategy == "channel":
        scheme.weights.strategy, scheme.weights.group_size = "channel", None
    args = scheme.weights
    state = load_file(str(target / "model.safetensors"))
    out, decompressed = {}, {}
    for name, weight in state.items():
        if not name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            out[name] = weight
            continue
        n, k = weight.shape
        size = args.group_size or k
        groups = weight.reshape(n, k // size, size)
        scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        parts = {"weight": weight, "weight_scale": scale.to(weight.dtype),
                 "weight_zero_point": zp}
        packed = PackedQuantizationCompressor.compress(parts, scheme)
        decompressed[name] = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
        prefix = name.rpartition(".")[0]
        out.update({f"{prefix}.{part}": t for part, t in packed.items()})
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": scheme.model_dump(mode="json")}, "ignore": ["lm_head"]}
    (target / "config.json").write_text(json.dumps(config))
    return target, decompressed


def dense_copy(folder, target, decompressed) -> str:
    """A plain checkpoint holding the decompressed weights: transformers' reference."""
    shutil.copytree(folder, target)
    state = {k: v for k, v in load_file(str(target / "model.safetensors")).items()
             if k.rpartition(".")[2] not in ("weight_packed", "weight_scale",
                                             "weight_zero_point", "weight_shape")}
    state.update({k: v.float().contiguous() for k, v in decompressed.items()})
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ct-base"), seed=4, **SHAPE)


@pytest.mark.parametrize("preset,strategy", [("W4A16", "group"), ("W4A16_ASYM", "group"),
                                             ("W8A16", "group"), ("W8A16", "channel")])
def test_the_codes_unpack_to_what_compressed_tensors_decompresses(base, tmp_path, preset,
                                                                  strategy):
    folder, decompressed = compress(base, tmp_path / "ct", preset, strategy)
    scheme = scheme_of(folder)
    assert (scheme.num_bits, scheme.strategy) == (8 if "W8" in preset else 4, strategy)
    assert scheme.symmetric == ("ASYM" not in preset)
    dense, packed = read_compressed(folder, scheme)
    assert set(dense) == set(packed) == set(decompressed)
    for name, reference in decompressed.items():
        ours = dense[name]
        # the dense path: the library's arithmetic (fp32 scales), within fp32 rounding
        torch.testing.assert_close(ours, reference.float(), rtol=0, atol=1e-6)
        # the packed codes: scales in fp16 (exact here, below 2^-14 they would round), m
        # rounded once with zero points
        served = quant_layout.dequantize(packed[name].packed, ours.shape[0])
        tol = 2e-3 * reference.abs().max().item() if "ASYM" in preset else 1e-3
        torch.testing.assert_close(served, reference.float(), rtol=1e-3, atol=tol)
        assert packed[name].kind == ("s8" if "W8" in preset else "u4")


@needs_library
@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM", "W8A16"])
def test_the_engine_serves_the_codes_as_transformers_serves_the_decompressed_model(
        base, tmp_path, preset):
    """fp32 through decode_layers: greedy token-identical (the fp32 tie rule) to transformers
    on the decompressed weights; --quantization none serves them dense. With zero points
    the reference is the packed codes' weights (m rounded to fp16 once: 2.5e-2 apart in a
    logit here, so not the library's fp32 arithmetic token for token)."""
    folder, decompressed = compress(base, tmp_path / "ct", preset)
    if "ASYM" in preset:
        _, packed = read_compressed(folder, scheme_of(folder))
        decompressed = {name: quant_layout.dequantize(p.packed, p.shape[0])
                        for name, p in packed.items()}
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4)
    plan = llm.engine.runner.plan
    assert (plan.weights, plan.mode) == ("compressed-tensors", "layers")
    assert plan.why_weights.startswith("auto: the checkpoint's compressed-tensors W")
    assert quant_layout.kind_of(llm.engine.runner.model.layers[0].mlp.down_proj.weight) == \
        ("s8" if "W8" in preset else "u4")
    prompts = mixed_prompts(llm.tokenizer, count=6, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    reference = dense_copy(folder, tmp_path / "dense", decompressed)
    refs = hf_greedy(reference, prompts, 12, set(llm.engine.eos_token_ids))
    assert_parity(outs, refs, TIE_GAP)
    dense = LLM(str(folder), dtype="float32", quantization="none", max_num_seqs=4)
    assert dense.engine.runner.plan.weights == "panels"
    if "ASYM" not in preset:  # the dense path is the library's arithmetic
        assert_parity([o.token_ids for o in dense.generate(prompts, params)], refs, TIE_GAP)


def test_what_is_not_served_is_refused_naming_the_field(base, tmp_path):
    folder, _ = compress(base, tmp_path / "ct", "W4A16")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())

    def refused(change, match):
        broken = json.loads(json.dumps(config))
        change(broken["quantization_config"])
        config_path.write_text(json.dumps(broken))
        with pytest.raises(CompressedError, match=match):
            scheme_of(folder)
        with pytest.raises(ValueError, match=match):  # and the engine says it at load
            LLM(str(folder), dtype="float32")

    group = ("config_groups", "group_0")
    refused(lambda q: q[group[0]][group[1]].update(
        input_activations={"num_bits": 8, "type": "int"}), "input_activations")
    refused(lambda q: q.update(format="float-quantized"), "format")
    refused(lambda q: q[group[0]][group[1]]["weights"].update(group_size=48), "group_size 48")
    refused(lambda q: q[group[0]][group[1]]["weights"].update(actorder="group"), "actorder")
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization 'compressed-tensors' needs"):
        LLM(str(base), dtype="float32", quantization="compressed-tensors")


@pytest.mark.parametrize("group", [64, 128])
def test_int4_in_groups_of_64_and_128(group):
    torch.manual_seed(0)
    weight = torch.randn(40, 256)
    packed = quant_layout.quantize(weight, "u4", group)
    d, q, m = quant_layout.unpack(packed, 40)
    wide = group // 32  # records sharing a group's scale and offset
    assert torch.equal(d, d[:, ::wide].repeat_interleave(wide, dim=1))
    assert torch.equal(m, m[:, ::wide].repeat_interleave(wide, dim=1))
    # each group's codes span 0..15 (its min and max are codes 0 and 15)
    grouped = q.reshape(40, 256 // group, group)
    assert (grouped.amin(-1) == 0).all() and (grouped.amax(-1) == 15).all()
    error = (quant_layout.dequantize(packed, 40) - weight).abs()
    finer = (quant_layout.dequantize(quant_layout.quantize(weight, "u4"), 40) - weight).abs()
    assert finer.mean() < error.mean() <= (d / 2 + 1e-3).repeat_interleave(32, 1).mean()
    with pytest.raises(ValueError, match="group"):
        quant_layout.quantize(weight, "u4", 48)


@needs_library
def test_the_plan_names_the_group(base):
    llm = LLM(str(base), dtype="float32", quantization="int4-g128", max_num_seqs=2)
    assert llm.engine.runner.plan.why_weights == \
        "quantized at load: groups of 128, scale and offset"
    d, _, _ = quant_layout.unpack(llm.engine.runner.model.layers[0].mlp.down_proj.weight,
                                  SHAPE["hidden_size"])
    assert torch.equal(d, d[:, ::4].repeat_interleave(4, dim=1))
