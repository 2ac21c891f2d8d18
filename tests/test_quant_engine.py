"""Quantized weights in the engine: --quantization int4 / int8 on a checkpoint, gguf on a GGUF
model (the embedded SmolLM2's Q4_1 / Q8_0 blocks). The quantized engine computes exactly the
dequantized model (greedy token-identical to transformers on a checkpoint holding the
dequantized weights), decode_layers gives the eager step bit for bit in bf16 as it does with
dense weights, and the plan names the form and refuses what cannot run."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tritonserve.engine import LLM, SamplingParams
from tritonserve.kernels import cpu, quant_layout
from tests.parity import TIE_GAP, assert_parity, hf_greedy
from tests.test_decode_layers import (SHAPE, _compare_with_eager, needs_op,
                                      nine_shrinking_to_one)
from tests.test_engine_parity import mixed_prompts
from tests.tiny_models import write_tiny_model

needs_library = pytest.mark.skipif(cpu.op("packed_linear_quant") is None,
                                   reason="no C++ toolchain")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory) -> str:
    """Llama, untied, head size 64 (the bf16 op's instances), every row length a multiple
    of 32."""
    return str(write_tiny_model(tmp_path_factory.mktemp("quant-llama"), seed=2, **SHAPE))


def dequantized_copy(folder: str, target, kind: str) -> str:
    """The checkpoint with every projection (kind) and the lm_head (s8) replaced by its
    quantized-then-dequantized weights: the dense model the quantized engine must equal."""
    shutil.copytree(folder, target)
    path = target / "model.safetensors"
    state = load_file(str(path))
    for name, weight in state.items():
        if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)) or name == "lm_head.weight":
            form = "s8" if name == "lm_head.weight" else kind
            state[name] = quant_layout.dequantize(quant_layout.quantize(weight, form),
                                                  weight.shape[0]).to(weight.dtype)
    save_file(state, str(path), metadata={"format": "pt"})
    return str(target)


@needs_library
@pytest.mark.parametrize("quantization,kind", [("int4", "u4"), ("int8", "s8")])
def test_the_quantized_engine_is_the_dequantized_model(quant_model, tmp_path, quantization,
                                                       kind):
    """fp32, through decode_layers and eager prefill: greedy output token-identical to
    transformers on the dequantized weights (the fp32 tie rule)."""
    llm = LLM(quant_model, dtype="float32", quantization=quantization, max_num_seqs=4)
    plan = llm.engine.runner.plan
    assert (plan.weights, plan.mode) == (quantization, "layers")
    prompts = mixed_prompts(llm.tokenizer, count=6, seed=3)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    folder = dequantized_copy(quant_model, tmp_path / "dequantized", kind)
    refs = hf_greedy(folder, prompts, 12, set(llm.engine.eos_token_ids))
    assert_parity([o.token_ids for o in outs], refs, TIE_GAP)
    # and not the dense model: the quantization changed the weights
    dense = LLM(quant_model, dtype="float32", quantization="none", max_num_seqs=4)
    assert dense.engine.runner.plan.weights == "panels"


@needs_op
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_decode_layers_gives_the_eager_step_bit_for_bit_on_quantized_weights(quant_model,
                                                                            quantization):
    """bf16: the op's hidden states and cache writes are the eager step's, bit for bit, at
    batches of 9 down to 1 (the same tiles in both; gate/up without the fused activation)."""
    llm = LLM(quant_model, dtype="bfloat16", decode_mode="eager", quantization=quantization,
              max_num_seqs=16)
    steps = nine_shrinking_to_one(llm)
    assert all(same for _, _, same in steps), [n for n, _, same in steps if not same]


@needs_library
def test_the_fp32_op_stays_within_rounding_of_eager_on_quantized_weights(tmp_path):
    """fp32, Qwen2 (qkv bias, tied embeddings: the lm_head is the quantized copy of the
    table, the lookup stays dense): the op within 1e-5 of the eager step."""
    folder = write_tiny_model(tmp_path / "qwen2", "Qwen2ForCausalLM", seed=3,
                              tie_word_embeddings=True)
    llm = LLM(str(folder), dtype="float32", decode_mode="eager", quantization="int4",
              max_num_seqs=16)
    model = llm.engine.runner.model
    assert quant_layout.kind_of(model.packed_tied_lm_head) == "s8"
    assert model.embed_tokens.weight.dtype == torch.float32
    steps = _compare_with_eager(llm)
    prompts = mixed_prompts(llm.tokenizer, count=5, seed=2)
    llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                           for n in (3, 6, 9, 12, 16)])
    assert {5, 1} <= {n for n, _, _ in steps}
    assert max(gap for _, gap, _ in steps) < 1e-5


@needs_library
def test_the_plan_names_the_form_and_refuses_what_cannot_run(quant_model):
    llm = LLM(quant_model, dtype="float32", quantization="int4", max_num_seqs=2)
    plan = llm.engine.runner.plan
    assert "weights int4" in plan.describe()
    assert plan.why_weights == "quantized at load: groups of 32, scale and offset"
    with pytest.raises(ValueError, match="quantization 'gguf' needs a GGUF model"):
        LLM(quant_model, dtype="float32", quantization="gguf")
    with pytest.raises(ValueError, match="quantization 'int8' runs on CUDA \\(Triton\\), or "
                                         "on the CPU with the C\\+\\+ library in float32 or "
                                         "bfloat16"):
        LLM(quant_model, dtype="float16", quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(quant_model, quantization="int3")
    auto = LLM(quant_model, dtype="float32", max_num_seqs=2)  # a checkpoint: dense
    assert auto.engine.runner.plan.weights == "panels"


@pytest.mark.slow
@needs_library
def test_smollm2_served_as_its_gguf_blocks_is_exact(smollm2_path):
    """The embedded model's file: every served block dequantizes to the converted fp32
    weight bit for bit, and in fp32 the engine on the blocks gives the dense conversion's
    greedy tokens (each step within the fp32 tie rule of it)."""
    from safetensors import safe_open

    from tritonserve.engine.default_model import gguf_path
    from tritonserve.engine.models.gguf import read_quantized

    tensors = read_quantized(gguf_path(), 9, 3)
    assert {t.type_name for t in tensors.values()} == {"Q4_1", "Q8_0"} and len(tensors) == 211
    with safe_open(f"{smollm2_path}/model.safetensors", framework="pt") as f:
        for name, tensor in tensors.items():
            assert torch.equal(quant_layout.dequantize(tensor.packed, tensor.shape[0]),
                               f.get_tensor(name)), name
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
    blocks = LLM(None, dtype="float32", quantization="gguf", max_num_seqs=4)
    plan = blocks.engine.runner.plan
    assert plan.weights == "gguf" and "Q4_1.gguf's own blocks" in plan.why_weights
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ours = [o.token_ids for o in blocks.generate(prompts, params)]
    dense = LLM(None, dtype="float32", quantization="none", max_num_seqs=4)
    assert dense.engine.runner.plan.weights == "panels"
    assert ours == [o.token_ids for o in dense.generate(prompts, params)]


@pytest.mark.slow
@needs_library
def test_a_gguf_file_as_model(tmp_path, monkeypatch):
    """--model FILE.gguf: converted once into the cache (config, tokenizer), its blocks
    served; the model is named after the file."""
    from tritonserve.engine.default_model import gguf_path

    monkeypatch.setenv("TRITONSERVE_CACHE", str(tmp_path / "cache"))
    llm = LLM(str(gguf_path()), dtype="bfloat16", quantization="gguf", max_num_seqs=2)
    assert llm.engine.model_name == gguf_path().stem
    assert llm.engine.runner.plan.weights == "gguf"
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert "Paris" in out.text
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        LLM(str(tmp_path / "missing.gguf"))


@pytest.mark.slow
@needs_library
def test_the_default_serves_its_blocks_and_bf16_panels_past_eight_rows():
    """The embedded model, auto: its GGUF blocks (the plan says so) for steps of up to 8
    rows, the bf16 panels of its conversion above (plan.dense_above): steps of 12 sequences
    run the dense weights, of 8 and fewer the quantized ones, and both answer (whichever decode
    path the plan took: the layers op, or on a CPU without AVX512-BF16 the compiled graph)."""
    llm = LLM(None, dtype="bfloat16", max_num_seqs=16)
    runner = llm.engine.runner
    assert (runner.plan.weights, runner.plan.dense_above) == ("gguf", 8)
    assert "steps of up to 8 rows; bf16 panels above" in runner.plan.describe()
    assert runner.plan.max_rows == 4  # bf16 blocks: speculative.BF16_INVARIANT_ROWS
    weights = runner.weights  # engine/weights.py
    assert weights.model_for(8) is runner.model and weights.model_for(9) is weights.dense
    calls = {"quantized": [], "dense": []}
    model_for = weights.model_for

    def spy(rows):
        model = model_for(rows)
        calls["dense" if model is weights.dense else "quantized"].append(rows)
        return model

    weights.model_for = spy
    prompts = [f"Count to {i}:" for i in range(12)]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=4 + i,
                                                 ignore_eos=True) for i in range(12)])
    assert [len(o.token_ids) for o in outs] == [4 + i for i in range(12)]
    assert calls["dense"] and min(calls["dense"]) > 8
    assert calls["quantized"] and max(calls["quantized"]) <= 8


def _q4_k(w):
    """A plain Q4_K quantizer for the test (gguf-py has none): per 32-wide sub block the
    range over 15 steps with the minimum clamped to <= 0, 6-bit scales and mins under fp16
    d / dmin, packed as llama.cpp lays them out (engine/models/gguf.py reads them back)."""
    import numpy as np
    n, k = w.shape
    sub = w.reshape(n, k // 256, 8, 32)
    low, high = np.minimum(sub.min(-1), 0), sub.max(-1)
    scale, mins = (high - low) / 15, -low
    d16 = (scale.max(-1) / 63).astype(np.float16)
    dmin16 = (mins.max(-1) / 63).astype(np.float16)
    d = np.where(d16 > 0, d16.astype(np.float32), 1)[..., None]
    dmin = np.where(dmin16 > 0, dmin16.astype(np.float32), 1)[..., None]
    sc = np.clip(np.round(scale / d), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(mins / dmin), 0, 63).astype(np.uint8)
    step = np.where(sc > 0, d * sc, 1)[..., None]
    q = np.clip(np.round((sub + (dmin * mn)[..., None]) / step), 0, 15).astype(np.uint8)
    scales = np.concatenate((sc[..., :4] | (sc[..., 4:] >> 4) << 6,
                             mn[..., :4] | (mn[..., 4:] >> 4) << 6,
                             (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4), axis=-1)
    codes = (q[..., 0::2, :] | q[..., 1::2, :] << 4).reshape(n, k // 256, 128)
    halves = np.stack((d16, dmin16), axis=-1).view(np.uint8)
    return np.concatenate((halves, scales, codes), axis=-1).reshape(n, -1)


@pytest.mark.slow
@needs_library
def test_a_k_quant_gguf_serves_its_blocks_in_every_kind_and_the_rest_dense(tmp_path,
                                                                            monkeypatch):
    """A llama.cpp K mix made from the embedded file: every ffn_down as Q4_K (layer 0's as
    Q6_K), every attn_v as Q5_0 beside the file's Q4_1 q and k (layer 1's as IQ4_NL, which
    has no block form, layer 2's as Q5_1). Under auto the engine serves Q4_K (u4), Q6_K (s8h)
    and each mixed q, k, v (s8hm) as blocks and layer 1's qkv dense, and gives the greedy
    tokens of the file's dequantized weights (--quantization none); in bf16 the layers op
    gives the eager step bit for bit on these blocks; asked for gguf by name it refuses,
    naming the IQ4_NL tensor."""
    import gguf
    import numpy as np
    from gguf import quants
    from tritonserve.engine.default_model import gguf_path
    from tritonserve.engine.models.gguf import GGUFError

    monkeypatch.setenv("TRITONSERVE_CACHE", str(tmp_path / "cache"))
    reader = gguf.GGUFReader(str(gguf_path()))
    path = tmp_path / "smollm2-kmix.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                             else None)
    types = gguf.GGMLQuantizationType
    tensors = []
    for t in reader.tensors:
        raw, ggml_type = t.data, t.tensor_type
        if ".ffn_down." in t.name or ".attn_v." in t.name:
            dense = quants.dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))
            if t.name.startswith("blk.0.ffn_down"):  # random codes and scales, small d
                rng = np.random.default_rng(0)
                raw = rng.integers(0, 256, (dense.shape[0], dense.shape[1] // 256 * 210),
                                   dtype=np.uint8).reshape(dense.shape[0], -1, 210)
                raw[:, :, 208:] = np.full(raw.shape[:2], 1e-4, np.float16)[..., None].view(
                    np.uint8)
                raw, ggml_type = raw.reshape(dense.shape[0], -1), types.Q6_K
            elif ".ffn_down." in t.name:
                raw, ggml_type = _q4_k(dense), types.Q4_K
            elif t.name.startswith("blk.1.attn_v"):  # random indices, small d
                rng = np.random.default_rng(1)
                raw = rng.integers(0, 256, (dense.shape[0], dense.shape[1] // 32, 18),
                                   dtype=np.uint8)
                raw[:, :, :2] = np.full(raw.shape[:2], 1e-3, np.float16)[..., None].view(
                    np.uint8)
                raw, ggml_type = raw.reshape(dense.shape[0], -1), types.IQ4_NL
            elif t.name.startswith("blk.2.attn_v"):
                raw, ggml_type = quants.quantize(dense, types.Q5_1), types.Q5_1
            else:
                raw, ggml_type = quants.quantize(dense, types.Q5_0), types.Q5_0
        tensors.append((t.name, raw, ggml_type))
        writer.add_tensor_info(t.name, raw.shape, raw.dtype, raw.nbytes, ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, raw, _ in tensors:
        writer.write_tensor_data(np.ascontiguousarray(raw))
    writer.close()

    prompts = ["The capital of France is", "def add(a, b):"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    blocks = LLM(str(path), dtype="float32", max_num_seqs=2)
    assert blocks.engine.runner.plan.weights == "gguf"
    layers = blocks.engine.runner.model.layers
    down = [quant_layout.kind_of(layer.mlp.down_proj.weight) for layer in layers]
    qkv = [quant_layout.kind_of(layer.self_attn.qkv_proj.weight) for layer in layers]
    assert down[:2] == ["s8h", "u4"] and qkv[:3] == ["s8hm", None, "s8hm"]
    served = [o.token_ids for o in blocks.generate(prompts, params)]
    del blocks
    dense = LLM(str(path), dtype="float32", quantization="none", max_num_seqs=2)
    assert served == [o.token_ids for o in dense.generate(prompts, params)]
    del dense
    if cpu.decode_layers(torch.bfloat16, 64, 3, 16) is not None:
        eager = LLM(str(path), dtype="bfloat16", decode_mode="eager", max_num_seqs=4)
        steps = _compare_with_eager(eager)
        eager.generate(prompts + ["1, 2, 3,"], [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 4, 6)])
        assert {n for n, _, _ in steps} == {3, 2, 1}
        assert all(same for _, _, same in steps), [n for n, _, same in steps if not same]
        del eager
    with pytest.raises(GGUFError, match="blk.1.attn_v.weight is IQ4_NL"):
        LLM(str(path), dtype="float32", quantization="gguf", max_num_seqs=2)
