from __future__ import annotations

import os

# CI has no GPU: Triton kernels run through the interpreter. This must be set before Triton
# decorates the kernels (at import); a CUDA run sets TRITON_INTERPRET=0 explicitly.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.tiny_models import write_tiny_model  # noqa: E402

ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    return {arch: str(write_tiny_model(tmp_path_factory.mktemp(arch), arch))
            for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from tritonserve.engine.default_model import default_model_path
    return str(default_model_path())


@pytest.fixture(scope="session")
def device() -> str:
    """Kernel tests run on CUDA when there is one (tritonserve/bench/gpu_check.sh), else
    interpreted."""
    import torch
    return "cuda" if torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] == "0" \
        else "cpu"


@pytest.fixture(scope="module")
def server(tiny_model):
    """A real server on the tiny model, per test module (test_server.py has its own)."""
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    from tests.server_util import ServerThread
    srv = ServerThread(LLMEngine(build_config(tiny_model)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client against `server`."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
