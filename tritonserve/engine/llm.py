"""Offline API: LLM(model=...).generate(prompts, params) -> one RequestOutput per prompt."""
from __future__ import annotations

from collections.abc import Sequence

from dataclasses import fields

from .config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from .limits import RequestLimits
from .llm_engine import LLMEngine
from .outputs import RequestOutput, TokenOutput
from .pooling import finish
from .sampling_params import SamplingParams

_CACHE_KEYS = {f.name for f in fields(CacheConfig)}
_SCHEDULER_KEYS = {f.name for f in fields(SchedulerConfig)}
# flat names (vLLM's where it has them) -> SpeculativeConfig fields
_SPECULATIVE_KEYS = {"speculative_method": "method", "num_speculative_tokens":
                     "num_speculative_tokens", "ngram_min": "ngram_min",
                     "ngram_max": "ngram_max", "speculative_max_batch": "max_batch",
                     "speculative_min_acceptance": "min_acceptance"}
_LIMIT_KEYS = {f.name for f in fields(RequestLimits)}


def build_config(model: str | None = None, **options) -> EngineConfig:
    """Flat keyword options (as on the command line) -> EngineConfig."""
    cache = {k: options.pop(k) for k in list(options) if k in _CACHE_KEYS}
    sched = {k: options.pop(k) for k in list(options) if k in _SCHEDULER_KEYS}
    spec = {_SPECULATIVE_KEYS[k]: options.pop(k) for k in list(options)
            if k in _SPECULATIVE_KEYS}
    limits = {k: options.pop(k) for k in list(options) if k in _LIMIT_KEYS}
    if "num_blocks" in cache and cache["num_blocks"] is not None:
        cache.setdefault("cache_bytes", None)
    return EngineConfig(model=model, cache=CacheConfig(**cache),
                        scheduler=SchedulerConfig(**sched),
                        speculative=SpeculativeConfig(**spec),
                        limits=RequestLimits(**limits), **options)


class LLM:
    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "auto",
                 **options) -> None:
        self.engine = LLMEngine(build_config(model, device=device, dtype=dtype, **options))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """lora: a LoRA adapter's name (--lora-modules / lora_modules) for every prompt, or
        one (or None: the base) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params must be one SamplingParams or one per prompt "
                             f"({len(prompts)}), got {len(params)}")
        engine = self.engine
        prompt_ids = [engine.tokenize(p) if isinstance(p, str) else list(p) for p in prompts]
        checked = []  # all valid (grammars compiled), or nothing is enqueued
        for token_ids, sp in zip(prompt_ids, params):
            sp = engine.validate(token_ids, sp)
            checked.append((token_ids, sp, engine.checker.compile(sp)))
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        ids = [engine.add_checked(token_ids, sp, grammar=grammar, lora=name)
               for (token_ids, sp, grammar), name in zip(checked, loras)]
        position = {request_id: i for i, request_id in enumerate(ids)}
        tokens: dict[str, list[TokenOutput]] = {i: [] for i in ids}
        results: dict[str, RequestOutput] = {}
        scored: dict[str, tuple] = {}  # prompt logprobs, by request
        embedded: dict[str, tuple] = {}  # pooled vectors, by request
        while len(results) < len(ids):
            for step in engine.step():
                if step.prompt_logprobs is not None:
                    scored[step.request_id] = step.prompt_logprobs
                if step.embedding is not None:
                    embedded[step.request_id] = step.embedding
                if step.token is not None:
                    tokens[step.request_id].append(step.token)
                if step.completion is not None:
                    i = position[step.request_id]
                    results[step.request_id] = self._output(
                        step, tokens[step.request_id], prompts[i], prompt_ids[i], params[i],
                        scored.get(step.request_id), embedded.get(step.request_id))
        return [results[i] for i in ids]

    def embed(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
              dimensions: int | None = None) -> list[list[float]]:
        """One embedding per prompt, pooled as the engine's Pooling says (engine/pooling.py)
        and normalised where it normalises."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        pooling = self.engine.pooling
        params = SamplingParams(max_tokens=0, pooling=pooling.kind)
        outs = self.generate(prompts, params)
        return [finish(o.embedding, pooling.normalize, dimensions) for o in outs]

    @staticmethod
    def _output(step, tokens: list[TokenOutput], prompt, prompt_ids: list[int],
                params: SamplingParams, prompt_logprobs=None,
                embedding=None) -> RequestOutput:
        done = step.completion
        return RequestOutput(
            request_id=step.request_id, prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=prompt_ids,
            token_ids=[t.token_id for t in tokens],
            text="".join(t.text for t in tokens) + done.tail_text,
            finish_reason=done.reason,
            logprobs=tokens if params.logprobs is not None else None,
            timing=done.timing, error=done.error, prompt_logprobs=prompt_logprobs,
            embedding=embedding)
