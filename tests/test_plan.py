"""The decode plan (engine/plan.py): resolved once at load, the same in the tests as shipped,
with a reason for each choice, named in the start-up line and by /version."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tritonserve.engine import LLM
from tritonserve.engine.config import EngineConfig
from tritonserve.engine.models import ModelArch
from tritonserve.engine.plan import resolve_plan
from tritonserve.kernels import cpu

PLAN_IN_A_CLEAN_PROCESS = """
import json, sys
from tritonserve.engine import LLM
print(json.dumps(LLM(sys.argv[1], max_num_seqs=2).engine.runner.plan.as_dict()))
"""


def test_the_tests_run_the_shipped_plan(tiny_model):
    """An engine built in this test process (conftest and all) has the plan a fresh process
    with none of the test fixtures resolves for the same model: no fixture swaps the path."""
    here = LLM(tiny_model, max_num_seqs=2).engine.runner.plan
    out = subprocess.run([sys.executable, "-c", PLAN_IN_A_CLEAN_PROCESS, tiny_model],
                         capture_output=True, text=True, check=True, cwd="/")
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here.as_dict()
    if cpu.load():  # the embedded model's dtype on most CPUs, and the tiny model's fp32
        assert (here.mode, here.weights, here.attention, here.draw) == (
            "layers", "panels", "cpu", "cpu")


def _plan(model: str, **overrides):
    config = EngineConfig(model=model, **{"dtype": "float32", **overrides})
    return resolve_plan(config, ModelArch.from_folder(model))


@pytest.mark.skipif(not cpu.load(), reason="no CPU library here")
def test_each_choice_says_why(tiny_model, tiny_models):
    plan = _plan(tiny_model)
    assert plan.mode == "layers" and plan.why_mode == "auto on the CPU in float32"
    qwen3 = _plan(tiny_models["Qwen3ForCausalLM"])
    assert qwen3.mode == "compile" and "q/k norms" in qwen3.why_mode
    assert "q/k norms" in qwen3.describe()
    with pytest.raises(ValueError, match="decode_mode 'layers' does not take .*q/k norms"):
        _plan(tiny_models["Qwen3ForCausalLM"], decode_mode="layers")
    eager = _plan(tiny_model, decode_mode="eager")
    assert (eager.mode, eager.why_mode, eager.weights) == ("eager", "asked", "panels")
    fp16 = _plan(tiny_model, dtype="float16")
    assert fp16.mode == "eager" and fp16.weights != "panels"


def test_without_the_library_the_plan_names_the_torch_paths(tiny_model, monkeypatch):
    monkeypatch.setattr(cpu, "load", lambda: False)
    plan = _plan(tiny_model)
    assert plan.attention == "torch" and plan.draw == "torch"
    assert plan.mode == "compile" and "no C++ CPU library" in plan.why_mode
    assert plan.weights == "plain"  # oneDNN's tensor is opaque to the compiled graph
    eager = _plan(tiny_model, decode_mode="eager")
    assert eager.weights in ("onednn", "plain") and eager.why_weights


def test_triton_attention_plans_eager_on_the_cpu(tiny_model):
    plan = _plan(tiny_model, attention_backend="triton", sampler_backend="triton")
    assert (plan.mode, plan.attention, plan.draw) == ("eager", "triton", "triton")
