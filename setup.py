from setuptools import find_packages, setup

setup(
    name="tritonserve",
    version="0.1.0",
    description="A vLLM-style LLM serving engine whose hot paths are Triton kernels",
    # One import name, `tritonserve` (tests/test_packaging.py): a generic top-level name such
    # as `kernels` is shadowed by, or shadows, a dependency's (transformers 5.25 imports HF's
    # `kernels` package).
    packages=find_packages(include=["tritonserve", "tritonserve.*"]),
    package_data={"tritonserve.kernels.cpu": ["*.cpp", "*.h"],
                  "tritonserve.server": ["static/*.html"],
                  "tritonserve.bench": ["*.sh", "data/*.jsonl"]},
    entry_points={"console_scripts": ["tritonserve = tritonserve.cli:main"]},
    python_requires=">=3.10",
    install_requires=[
        # A range that the CPU build 2.13.0 satisfies; scripts/bootstrap.sh pins it first
        # so pip never pulls a multi-GB CUDA build.
        "torch>=2.4,<2.15",
        "triton>=3.0",
        "transformers>=4.45",
        "tokenizers>=0.19",
        "safetensors>=0.4",
        "aiohttp>=3.9",
        "pydantic>=2.6",
        "prometheus-client>=0.20",
        "numpy>=1.26",
        # Grammars for structured output and forced tool calls (vLLM's and SGLang's default);
        # its token bitmask is applied in the sampler (engine/structured.py).
        "xgrammar>=0.1.25",
        # Needed once, to convert the embedded SmolLM2 GGUF into safetensors.
        "gguf>=0.10",
        "accelerate>=0.30",
        # Builds the CPU decode-attention op (kernels/cpu/__init__.py) with torch's extension
        # builder; without it (or a C++ compiler) the plain-torch path serves.
        "ninja>=1.11",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100", "openai>=1.40", "matplotlib>=3.8",
                 # the client agent frameworks drive servers with (tests/test_langchain.py)
                 "langchain-openai>=1.6",
                 # writes the W4A16 / W8A16 fixture checkpoints and decompresses them
                 # (tests/test_compressed_checkpoint.py); the engine reads them without it
                 "compressed-tensors>=0.20",
                 # tests/test_packaging.py builds the wheel offline (--no-build-isolation)
                 "setuptools>=70.1",
                 # the clients of the Messages API, of loglikelihood evals and of N servers
                 # (tests/test_anthropic_messages.py, tests/test_lm_eval.py, tests/test_router.py)
                 "anthropic>=0.60", "lm-eval>=0.4.9", "sglang-router>=0.2",
                 "vllm-router>=0.1.10",
                 # makes the LoRA adapters and their merged models (tests/test_lora.py)
                 "peft>=0.15"],
    },
)
