"""--dtype auto (the default): the model's dtype, except on a CPU that cannot run bf16 / fp16
natively, where it falls back to float32 with one log line."""
from __future__ import annotations

import logging

import pytest

import tritonserve.engine.dtype as dtype

from tritonserve.engine import LLM
from tritonserve.engine.models import ModelArch


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_the_model_where_the_cpu_runs_it(monkeypatch, caplog, native):
    monkeypatch.setattr(dtype, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level(logging.INFO, logger="tritonserve.engine"):
        got = dtype.resolve_dtype("auto", "bfloat16", "cpu")
    assert got == ("bfloat16" if native else "float32")
    assert ("no native bfloat16" in caplog.text) is (not native)


def test_auto_elsewhere():
    assert dtype.resolve_dtype("auto", "float16", "cpu") == "float32"  # no fast fp16 on CPUs
    assert dtype.resolve_dtype("auto", None, "cpu") == "float32"
    assert dtype.resolve_dtype("auto", "float32", "cpu") == "float32"
    assert dtype.resolve_dtype("auto", "bfloat16", "cuda") == "bfloat16"
    assert dtype.resolve_dtype("auto", "float16", "cuda:0") == "float16"
    assert dtype.resolve_dtype("bfloat16", "float32", "cpu") == "bfloat16"  # asked for


def test_the_checkpoint_dtype_is_read_from_either_key():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelArch.from_dict({**base, "torch_dtype": "bfloat16"}).torch_dtype == "bfloat16"
    assert ModelArch.from_dict({**base, "dtype": "float16"}).torch_dtype == "float16"
    assert ModelArch.from_dict(base).torch_dtype is None


def test_engine_default_is_auto_and_resolved(tiny_model):
    engine = LLM(tiny_model).engine
    assert engine.config.dtype == "float32"  # the tiny checkpoint is float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(tiny_model, dtype="int8")


@pytest.mark.smollm2
def test_embedded_model_defaults_to_bf16_where_the_cpu_has_it(smollm2_path):
    """The embedded SmolLM2 records its upstream dtype (bf16), so `tritonserve serve` with no
    dtype flag runs bf16 on a CPU with native bf16 and fp32 elsewhere."""
    assert ModelArch.from_folder(smollm2_path).torch_dtype == "bfloat16"
    assert dtype.resolve_dtype("auto", "bfloat16", "cpu") == (
        "bfloat16" if dtype.cpu_has_native_bf16() else "float32")
