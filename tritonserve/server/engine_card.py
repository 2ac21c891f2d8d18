"""What the server may say about its engine, as frozen records: the model card (fixed at
start-up), the stats snapshot an engine takes after each step, one engine as /metrics and
/health see it, and how an LLMEngine makes the first two (server/async_engine.py's thread and a
data-parallel engine process, server/engine_process.py, both call them)."""
from __future__ import annotations

from dataclasses import dataclass

from tritonserve.engine import LLMEngine
from tritonserve.engine.plan import DecodePlan
from tritonserve.engine.pooling import Pooling


@dataclass(frozen=True)
class ModelCard:
    """What the server may say about the model it serves (fixed at start-up)."""

    name: str
    root: str  # the model folder
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    dtype: str  # what --dtype auto resolved to
    plan: DecodePlan  # what the steps run, with why (engine/plan.py)
    kernels: str  # which kernels serve: "Triton (CUDA)", "C++ CPU ops (ISA ...)", "torch"
    aliases: tuple[str, ...] = ()  # --served-model-name: then the only names, name the first
    engines: int = 1  # data-parallel engines (num_kv_blocks is their sum)
    hidden_size: int = 0  # an embedding's length before `dimensions`
    pooling: Pooling | None = None  # how /v1/embeddings pools (engine/pooling.py)
    loras: tuple[str, ...] = ()  # LoRA adapters a request's `model` may name (engine/lora.py)
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype (auto: the model's dtype)

    def names(self) -> tuple[str, ...]:
        """The names a request's `model` field may use (the folder's path too, as vLLM)."""
        return self.aliases or (self.name, self.root)

    def public_names(self) -> tuple[str, ...]:
        """The names the server shows (/v1/models, a 404): never its own paths."""
        return self.aliases or (self.name,)


@dataclass(frozen=True)
class EngineStats:
    """Taken on the engine thread after admitting requests and after each step."""

    num_running: int = 0
    num_waiting: int = 0  # in the engine's queue (the inbox is counted by AsyncEngine)
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens whose KV blocks were found
    spec_drafts: int = 0  # speculating request-steps (engine/speculative.py), since start
    spec_draft_tokens: int = 0  # proposals verified
    spec_accepted_tokens: int = 0  # of those, accepted


@dataclass(frozen=True)
class EngineView:
    """One engine as /metrics and /health see it."""

    index: int
    alive: bool
    pid: int
    stats: EngineStats
    outstanding_tokens: int  # what the data-parallel router counts (0 for one engine)


def stats_of(engine: LLMEngine) -> EngineStats:
    prefix, spec = engine.kv_cache.stats, engine.spec_stats
    return EngineStats(engine.num_running, engine.num_waiting, engine.kv_cache.usage,
                       engine.scheduler.num_preemptions, prefix.queried_tokens,
                       prefix.hit_tokens, spec.steps, spec.proposed, spec.accepted)


def card_of(engine: LLMEngine, served_names: tuple[str, ...] = ()) -> ModelCard:
    return ModelCard(
        name=served_names[0] if served_names else engine.model_name,
        root=str(engine.model_path), aliases=tuple(served_names),
        max_model_len=engine.max_model_len, vocab_size=engine.arch.vocab_size,
        num_kv_blocks=engine.kv_cache.num_blocks, block_size=engine.kv_cache.block_size,
        dtype=engine.config.dtype, plan=engine.runner.plan,
        kernels=engine.runner.kernels_in_use(), hidden_size=engine.arch.hidden_size,
        pooling=engine.pooling, loras=tuple(engine.loras),
        kv_cache_dtype=engine.config.cache.kv_cache_dtype)
