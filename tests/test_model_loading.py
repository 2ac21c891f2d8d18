"""Strict weight loading: sharded folders load; missing, unexpected and mis-shaped tensors
fail loudly; dummy weights need only the config."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tritonserve.engine import LLM, SamplingParams
from tritonserve.engine.models import ModelArch, WeightLoadError, build_model
from tritonserve.kernels import cpu


def copy_with(tiny_model, tmp_path, edit):
    folder = tmp_path / "edited"
    shutil.copytree(tiny_model, folder)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def load(folder):
    arch = ModelArch.from_folder(folder)
    return build_model(arch, folder, torch.float32, torch.device("cpu"), 64)


def test_missing_tensor_is_named(tiny_model, tmp_path):
    folder = copy_with(tiny_model, tmp_path,
                       lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensors: .*layers\.1\.mlp\.up_proj"):
        load(folder)


def test_unexpected_tensor_is_named(tiny_model, tmp_path):
    folder = copy_with(tiny_model, tmp_path,
                       lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
    with pytest.raises(WeightLoadError, match=r"unexpected tensors: .*extra"):
        load(folder)


def test_mis_shaped_tensor_is_named(tiny_model, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t[
            "model.layers.0.self_attn.k_proj.weight"][:-1]
    folder = copy_with(tiny_model, tmp_path, shrink)
    with pytest.raises(WeightLoadError, match=r"mis-shaped tensors: .*k_proj"):
        load(folder)


def test_sharded_checkpoint_loads_the_same_model(tiny_model, tmp_path):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model)
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="100KB")
    for item in Path(tiny_model).iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(item, folder / item.name)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    params = SamplingParams(temperature=0.0, max_tokens=8)
    assert (LLM(str(folder)).generate(["Hello world"], params)[0].token_ids
            == LLM(tiny_model).generate(["Hello world"], params)[0].token_ids)


def test_dummy_weights_from_config_alone(tiny_model, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    for item in Path(tiny_model).iterdir():
        if not item.name.endswith(".safetensors"):
            shutil.copy(item, folder / item.name)
    out = LLM(str(folder), load_format="dummy").generate(
        ["Hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_cache_larger_than_memory_is_rejected_by_name(tiny_model):
    with pytest.raises(ValueError, match="cache_bytes"):
        LLM(tiny_model, cache_bytes=1 << 50)


def test_cache_size_in_blocks_or_bytes(tiny_model):
    assert LLM(tiny_model, num_blocks=40).engine.kv_cache.num_blocks == 40
    arch_bytes = LLM(tiny_model, num_blocks=1).engine.arch.kv_bytes_per_token(torch.float32)
    llm = LLM(tiny_model, cache_bytes=arch_bytes * 16 * 7 + 5)
    assert llm.engine.kv_cache.num_blocks == 7


def test_unsupported_architecture_is_rejected():
    with pytest.raises(ValueError, match="^GPT2LMHeadModel is not supported \\(supported: "):
        ModelArch.from_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_engine_cli_generates(tiny_model):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "tritonserve.engine", "generate", "--model",
                           tiny_model, "--prompt", "Hello", "--max-tokens", "5", "--enforce-eager"],
                          capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--- " in proc.stdout and "5 tokens" in proc.stdout


def test_bench_kernels_runs_on_cpu():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "tritonserve.bench", "kernels", "--batch", "2",
                           "--context", "64", "--heads", "4", "--kv-heads", "2",
                           "--head-dim", "64", "--sample-batch", "2", "--vocab", "512"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "torch reference" in proc.stdout and "no CUDA device" in proc.stdout


@pytest.mark.parametrize("dtype,tolerance,packed", [
    (torch.float32, 1e-4, None), (torch.float32, 1e-4, "onednn"),
    (torch.float32, 1e-4, "panels"),
    (torch.bfloat16, 3e-2, None), (torch.bfloat16, 3e-2, "onednn"),
    (torch.bfloat16, 3e-2, "panels"),
    (torch.float16, 3e-3, None),  # no oneDNN inner product for fp16: F.linear
])
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 16, 37, 300])
def test_linear_matches_float64(dtype, tolerance, packed, rows):
    """linear (C++ panels for fp32 and bf16, oneDNN on the CPU for fp32/bf16, plain or
    prepacked weights; F.linear otherwise) against float64 (the bf16 panels' own tiles and
    odd K: tests/test_cpu_panels_bf16.py). N = 165 leaves a partial last panel, K = 301
    a k-chunk of 256 plus a remainder; 7 and 37 rows cover full and partial 6-row tiles (2, 7
    and 16 with the first tile prefetching the next chunk, past the last panel's end too), 300
    two of the panels' row blocks (216 + 84 rows of 301 floats: 256 KB blocks)."""
    from tritonserve.engine.models.linear import has_form, linear, pack
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 301, generator=generator).to(dtype)
    weight = torch.randn(165, 301, generator=generator).to(dtype) / 10
    bias = torch.randn(165, generator=generator).to(dtype)
    if packed == "onednn" and not has_form("onednn", dtype):
        pytest.skip("oneDNN cannot prepack this dtype on this CPU")
    if packed == "panels" and not has_form("panels", dtype):
        pytest.skip("the C++ CPU ops are unavailable")
    used = weight if packed is None else pack(weight, packed, 64)
    for b in (None, bias):
        with torch.inference_mode():
            out = linear(x, used, b, out_features=165)
        assert out.shape == (rows, 165) and out.dtype == dtype
        expected = x.double() @ weight.double().t() + (0 if b is None else b.double())
        if rows:
            error = (out.double() - expected).abs().max().item()
            assert error <= tolerance * expected.abs().max().item()


def test_bf16_mlp_applies_silu_in_the_matmul(tiny_model):
    """On the CPU in bf16 every MLP's gate/up carries the activation in its epilogue
    (MLP.fuse_silu) and gives what the unfused gate/up, silu_and_mul, down path gives."""
    import copy

    from tritonserve.engine.models.decoder import MLP
    from tritonserve.engine.models.ops import silu_and_mul
    model = LLM(tiny_model, dtype="bfloat16").engine.runner.model
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    if cpu.op("packed_linear_silu_mul_bf16") is None:
        assert not any(m.silu_in_matmul for m in mlps)
        pytest.skip("the C++ CPU ops are unavailable")
    assert mlps and all(m.silu_in_matmul for m in mlps)
    arch = model.arch
    plain = MLP(arch).bfloat16()
    fused = copy.deepcopy(plain)
    fused.fuse_silu()
    assert fused.silu_in_matmul and not plain.silu_in_matmul
    x = torch.randn(9, arch.hidden_size).bfloat16()
    with torch.inference_mode():
        expected = plain.down_proj(silu_and_mul(plain.gate_up_proj(x)))
        torch.testing.assert_close(fused(x), expected, atol=0, rtol=1e-2)
        fused.fuse_silu()  # a second call changes nothing
        torch.testing.assert_close(fused(x), expected, atol=0, rtol=1e-2)


def test_bfloat16_engine_tracks_float32(tiny_model):
    prompts = ["Hello world", "The cat sat on", "a b c d e f", "Once upon a time",
               "x", "numbers 1 2 3", "What is the", "tokens tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    full = LLM(tiny_model).generate(prompts, params)
    half = LLM(tiny_model, dtype="bfloat16").generate(prompts, params)
    assert all(len(out.token_ids) == 6 for out in half)
    agree = sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(full, half))
    assert agree >= 6, f"bf16 first tokens agree with fp32 for only {agree} of 8 prompts"


def test_linear_keeps_gradients_right_outside_inference_mode():
    from tritonserve.engine.models.linear import linear
    weight = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 4)
    linear(x, weight).sum().backward()
    torch.testing.assert_close(weight.grad, x.sum(0).expand(8, 4))


def test_prepacked_weights_refuse_inputs_that_need_gradients():
    from tritonserve.engine.models.linear import has_form, linear, pack
    weight = torch.randn(8, 4)
    forms = [f for f in ("panels", "onednn") if has_form(f, weight.dtype)]
    if not forms:
        pytest.skip("no packed CPU weights here")
    packed = pack(weight, forms[0], 8)
    with pytest.raises(RuntimeError, match="inference only"):
        linear(torch.randn(3, 4, requires_grad=True), packed, out_features=8)


def test_panel_weights_need_out_features():
    from tritonserve.engine.models.linear import has_form, linear, pack
    weight = torch.randn(20, 4)
    if not has_form("panels", weight.dtype):
        pytest.skip("the C++ CPU ops are unavailable")
    with torch.inference_mode(), pytest.raises(ValueError, match="out_features"):
        linear(torch.randn(3, 4), pack(weight, "panels", 0))


def test_cpu_engine_runs_on_prepacked_weights(tiny_model):
    """The fast path is the one the parity tests exercise: every projection is packed (C++
    panels for fp32 when the library is built, else oneDNN's layout)."""
    from tritonserve.engine.models.linear import Linear, has_form
    model = LLM(tiny_model).engine.runner.model
    plain = model.embed_tokens.weight
    if has_form("panels", plain.dtype):
        is_packed = lambda w: w.dim() == 3  # noqa: E731  (fp32 panels)
    elif has_form("onednn", plain.dtype):
        is_packed = lambda w: w.is_mkldnn  # noqa: E731
    else:
        pytest.skip("no packed CPU weights here")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(is_packed(m.weight) for m in linears)
    assert model.packed_tied_lm_head is None or is_packed(model.packed_tied_lm_head)
    assert model.packed_tied_lm_head is not None or not model.arch.tie_word_embeddings
