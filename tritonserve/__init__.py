"""tritonserve: a vLLM-style LLM serving engine. One import package, four parts layered
kernels <- engine <- server <- bench (docs/architecture.md); `tritonserve` on the command line
is tritonserve/cli.py."""
__version__ = "0.1.0"


def __getattr__(name: str):
    """`from tritonserve import LLM, SamplingParams`, as `from vllm import LLM`; imported on
    first use, so the command line's start stays light."""
    if name in ("LLM", "SamplingParams"):
        from tritonserve import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'tritonserve' has no attribute {name!r}")
