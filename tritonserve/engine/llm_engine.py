"""LLMEngine: add_request / step / abort. Each step yields one GenerationStep per request that
something happened to, so EOS, stop and max-tokens termination can never look alike.

Failure isolation: an exception while turning one request's sample into output fails that
request alone (a GenerationStep with FinishReason.ERROR); a failed forward pass fails the
requests of that batch and the next step goes on. Only a device fault, MAX_FAILED_STEPS failed
forwards in a row, or broken bookkeeping raise EngineDeadError, which carries the steps already
produced so that no finished request is lost.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from pathlib import Path

from transformers import AutoTokenizer

from .config import EngineConfig
from .default_model import gguf_source
from .disk_cache import DiskPrefixCache, cache_identity
from .detokenizer import IncrementalDetokenizer, StopCheck, StopStringMatcher
from .errors import EngineDeadError, InvalidRequestError, NoTokenAllowedError
from .kv_cache import KVCacheManager
from .memory import (check_weights_fit, num_cache_blocks, profiled_cache_blocks,
                     profiles_cache, resolve_max_model_len)
from .lora import LoraAdapter, load_adapter
from .pooling import pooled_vector, resolve_pooling
from .outputs import (Completion, FinishReason, GenerationStep, RequestTiming, TokenOutput)
from .request import Request
from .reasoning_end import TagFinder
from .request_check import RequestChecker
from .sampler import SampledToken
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .speculative import NgramProposer, SpecStats, record_acceptance
from .structured import Grammars
from .resolve import resolved
from .tp_runner import make_runner

log = logging.getLogger("tritonserve.engine")

MAX_FAILED_STEPS = 3  # forward passes failing in a row before the engine declares itself dead
PROMPT_DETOKENIZE_CONTEXT = 5  # prompt tokens the detokenizer sees before the output (as vLLM)


class LLMEngine:
    """Single-threaded: call it from one thread (server/async_engine.py hosts it)."""

    def __init__(self, config: EngineConfig) -> None:
        self.model_path, self.arch, config, max_positions = resolved(config)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        check_weights_fit(config, self.arch, gguf_source(self.model_path))
        # the CPU's cache is sized before the weights take memory, CUDA's after (profiled)
        num_blocks = None if profiles_cache(config) else num_cache_blocks(config, self.arch)
        self.runner = make_runner(config, self.arch, self.model_path, max_positions,
                                  gguf_source(self.model_path))
        if num_blocks is None:
            peak = self.runner.profile_peak_bytes(max_positions)
            num_blocks = profiled_cache_blocks(config, self.arch, peak)
        self.max_model_len = resolve_max_model_len(config, self.arch, num_blocks)
        self.runner.allocate(num_blocks, self.max_model_len)
        self.kv_cache = KVCacheManager(num_blocks, config.cache.block_size,
                                       config.cache.enable_prefix_caching,
                                       self._disk_tier(config))
        spec = config.speculative
        proposer = (NgramProposer(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
                    if spec.method == "ngram" else None)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, proposer, spec.max_batch,
                                   self.max_model_len, self.runner.plan.max_rows,
                                   spec.min_acceptance,
                                   config.scheduler.step_tokens_under_priority(config.device),
                                   config.scheduler.long_prefill_tokens_on(config.device))
        self.spec_stats = SpecStats()
        eos = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.pooling = resolve_pooling(self.model_path, config.pooling)  # for embeddings
        self.loras = self._load_loras(config)
        self.checker = RequestChecker(self.tokenizer, self.arch.vocab_size, self.eos_token_ids,
                                      self.max_model_len, config.limits)
        self._requests: dict[str, Request] = {}
        self._pending_aborts: list[str] = []
        self._ids = itertools.count()
        self._failed_steps = 0  # forward passes failed in a row

    @property
    def grammars(self) -> Grammars:
        """Built on the first structured request (it reads the whole vocabulary once)."""
        return self.checker.grammars

    def _disk_tier(self, config: EngineConfig) -> DiskPrefixCache | None:
        """--prefix-cache-dir: the prefix cache's second tier, over the runner's cache."""
        cache = config.cache
        if not cache.prefix_cache_dir or not cache.enable_prefix_caching:
            return None
        identity = cache_identity(self.model_path, gguf_source(self.model_path),
                                  config.torch_dtype, {
                                      "quantization": config.quantization,
                                      "kv_cache_dtype": cache.kv_cache_dtype,
                                      "load_format": config.load_format,
                                      "seed": config.seed if config.load_format == "dummy"
                                      else None})
        disk = DiskPrefixCache(cache.prefix_cache_dir, int(cache.prefix_cache_disk_gb * 2**30),
                               identity, self.runner.kv_caches)
        log.info("%s", disk.describe())
        return disk

    def _load_loras(self, config: EngineConfig) -> dict[str, LoraAdapter]:
        """--lora-modules name=path ... (a PEFT folder or a GGUF LoRA file): each checked
        against this base (engine/lora.py)."""
        if not config.lora_modules:
            return {}
        model = getattr(self.runner, "model", None)
        if config.tensor_parallel_size > 1 or self.arch.variant.experts is not None or (
                model is not None and any(getattr(layer.mlp, "silu_in_matmul", False)
                                          for layer in model.layers)):
            raise ValueError("LoRA adapters are served on one rank and dense MLP layers for "
                             "now (and gate/up without silu fused into its matmul, which "
                             "EngineConfig.serves_lora keeps)")
        loras = {}
        for spec in config.lora_modules:
            name, _, folder = spec.partition("=")
            if not name or not folder:
                raise ValueError(f"--lora-modules takes name=path, got {spec!r}")
            loras[name] = load_adapter(name, folder, self.arch, config.max_lora_rank,
                                       config.torch_dtype)
        return loras

    # ---- public API ----------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        model = self.config.model
        return Path(model).stem if model and model.endswith(".gguf") else self.model_path.name

    def lora_users(self, name: str) -> int:
        """Requests running or queued here under that LoRA adapter (a snapshot: safe to take
        from another thread)."""
        return sum(1 for r in list(self._requests.values())
                   if r.lora is not None and r.lora.name == name)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Raise InvalidRequestError for a request that could never run (engine/request_check.py)."""
        return self.checker.validate(prompt_token_ids, params)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    prefill_after: str | None = None, grammar=None,
                    lora: str | None = None) -> str:
        """Validates the request (engine/request_check.py), then add_checked. prefill_after:
        the id of a request with the same prompt (a sibling choice of n); this one is
        scheduled once that one's prompt is computed, and then finds the prompt's full blocks
        in the prefix cache instead of computing them again. grammar: the request's
        structured output already compiled; None compiles it here."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, list(prompt)
        params = self.validate(token_ids, params)
        if grammar is None and params.structured is not None:
            grammar = self.checker.compile(params)
        return self.add_checked(token_ids, params, request_id, arrival_time, prefill_after,
                                grammar, text, lora)

    def add_checked(self, token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, arrival_time: float | None = None,
                    prefill_after: str | None = None, grammar=None,
                    prompt: str | None = None, lora: str | None = None) -> str:
        """A request its host has checked already (RequestChecker.validate's parameters, its
        grammar compiled off the event loop: server/async_engine.py, server/engine_process.py),
        added without checking it again."""
        request_id = request_id or f"req-{next(self._ids)}"
        if lora is not None and lora not in self.loras:
            raise InvalidRequestError("model", f"no LoRA adapter {lora!r} is loaded")
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        request = Request(
            request_id=request_id, prompt=prompt, prompt_token_ids=token_ids, params=params,
            arrival_time=arrival_time if arrival_time is not None else time.perf_counter(),
            eos_token_ids=self.eos_token_ids,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens,
                token_ids[-PROMPT_DETOKENIZE_CONTEXT:]),
            stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output),
            prefill_after=self._requests.get(prefill_after) if prefill_after else None,
            matcher=self.grammars.matcher(grammar) if grammar is not None else None,
            lora=self.loras.get(lora) if lora is not None else None)
        if params.structured_after and request.matcher is not None:
            request.held_matcher, request.matcher = request.matcher, None
            request.reasoning_end = TagFinder(params.structured_after)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Queued; applied at the start of the next step, which reports it as `abort`. An id
        that is not running now is dropped at once: kept, it would end a later request that
        reuses the id (a client retrying with its X-Request-Id)."""
        if request_id in self._requests and request_id not in self._pending_aborts:
            self._pending_aborts.append(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks; False, and nothing forgotten, while a request is
        unfinished (its blocks are the cache's)."""
        if self._requests:
            return False
        self.kv_cache.settle_disk(drain=True)  # the disk tier's pins
        return self.kv_cache.reset_prefix_cache()

    def check_health(self) -> None:
        """Raises EngineDeadError when the engine cannot step any more while it idles (a
        tensor-parallel worker gone: engine/tp_runner.py)."""
        try:
            self.runner.check_health()
        except Exception as exc:  # noqa: BLE001 - any reason is the engine's death
            raise EngineDeadError(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Stops what the engine started beside this process (tensor-parallel workers, the
        disk tier's writer, once its files are written)."""
        if self.kv_cache.disk is not None:
            self.kv_cache.disk.close()
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def abort_all(self) -> list[GenerationStep]:
        """End every request now (after an engine failure); returns their abort steps."""
        self._pending_aborts.extend(self._requests)
        return self._apply_aborts()

    def step(self) -> list[GenerationStep]:
        """One forward pass. Never raises for one request's fault (see the module docstring);
        raises EngineDeadError when the engine cannot go on."""
        steps: list[GenerationStep] = []
        try:
            self._step(steps)
        except EngineDeadError as exc:
            exc.steps[:0] = steps
            raise
        except Exception as exc:  # noqa: BLE001 - the scheduler or cache state is broken
            log.exception("engine bookkeeping failed")
            raise EngineDeadError(f"engine state is broken: {type(exc).__name__}: {exc}",
                                  steps) from exc
        return steps

    # ---- internals -----------------------------------------------------------------------
    def _step(self, steps: list[GenerationStep]) -> None:
        steps.extend(self._apply_aborts())
        self.kv_cache.settle_disk()
        schedule = self.scheduler.schedule()
        if schedule.empty:
            if self.kv_cache.reading:  # nothing to do but wait for a prefix read from disk
                self.kv_cache.settle_disk(wait_s=0.05)
            return
        started = time.perf_counter()
        try:
            sampled = self.runner.execute(schedule)
        except Exception as exc:  # noqa: BLE001 - fail this batch, or the engine
            self._failed_steps += 1
            log.exception("forward pass failed (%d in a row)", self._failed_steps)
            message = f"{type(exc).__name__}: {exc}"
            if self.runner.is_device_fatal(exc) or self._failed_steps >= MAX_FAILED_STEPS:
                raise EngineDeadError(message) from exc
            steps.extend(self._fail(s.request, message) for s in schedule.scheduled)
            return
        self._failed_steps = 0
        now = time.perf_counter()
        self.scheduler.account(schedule, now - started)
        for s in schedule.scheduled:
            request = s.request
            try:
                tokens = sampled.get(request.request_id) or []
                if s.proposals:  # the last token and the accepted proposals are computed
                    accepted = max(0, len(tokens) - 1)
                    self.spec_stats.add(len(s.proposals), accepted)
                    record_acceptance(request, len(s.proposals), accepted)
                    request.num_computed_tokens += 1 + accepted
                    self.kv_cache.trim(request)  # the rejected tail's slots go back
                else:
                    request.num_computed_tokens += s.num_new_tokens
                    self.kv_cache.cache_full_blocks(request)
                first = len(steps)
                if request.params.max_tokens == 0:  # scored or embedded: no token is drawn
                    if s.samples:
                        steps.append(self._prompt_done(request, now))
                else:
                    for token in tokens:  # a stop or max_tokens cuts an accepted run as usual
                        step = self._on_token(request, token, now)
                        steps.append(step)
                        if step.finished:
                            break
                if len(steps) > first and request.params.prompt_logprobs is not None \
                        and not request.prompt_logprobs_sent:
                    steps[first] = self._with_prompt_logprobs(request, steps[first])
                if s.proposals and request.request_id in self._requests:
                    self.kv_cache.cache_full_blocks(request)  # the accepted tokens are in
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                if isinstance(exc, NoTokenAllowedError):  # the request's own doing
                    log.info("%s: %s", request.request_id, exc)
                else:
                    log.exception("output processing failed for %s", request.request_id)
                if request.request_id in self._requests:
                    steps.append(self._fail(request, f"{type(exc).__name__}: {exc}"))
        self.kv_cache.write_behind()

    def _apply_aborts(self) -> list[GenerationStep]:
        steps = []
        pending, self._pending_aborts = self._pending_aborts, []
        for request_id in pending:
            request = self._requests.get(request_id)
            if request is not None:
                steps.append(self._finish(request, FinishReason.ABORT, time.perf_counter()))
        return steps

    def _on_token(self, request: Request, sampled: SampledToken, now: float) -> GenerationStep:
        params = request.params
        if request.first_token_time is None:
            request.first_token_time = now
        token_id = sampled.token_id
        if token_id < 0:  # the sampler found every token forbidden (sampler.NO_TOKEN)
            raise NoTokenAllowedError(
                "no token is allowed: the request's rules (grammar, min_tokens with "
                "stop_token_ids, logit_bias) forbid every token of the vocabulary")
        if request.matcher is not None:
            if not request.matcher.accept_token(token_id):
                raise RuntimeError(f"the grammar refused token {token_id}")
            if request.matcher.is_terminated():  # the grammar is complete: EOS came
                drained = self._drain(request)
                eos = token_id in request.eos_token_ids
                reason = FinishReason.EOS if eos else FinishReason.STOP
                return self._finish(request, reason, now, None, drained.text)
        if token_id in params.stop_token_ids:
            drained = self._drain(request)
            return self._finish(request, FinishReason.STOP, now, token_id, drained.text)
        if token_id in request.eos_token_ids and not params.ignore_eos:
            drained = self._drain(request)
            reason = FinishReason.STOP if drained.matched else FinishReason.EOS
            return self._finish(request, reason, now, drained.matched, drained.text)

        request.token_ids.append(token_id)
        delta = request.detokenizer.add_token(token_id)
        if request.held_matcher is not None and request.reasoning_end.feed(delta):
            # reasoning over (the server's split sees the same tag): the grammar from now on
            request.matcher, request.held_matcher = request.held_matcher, None
        # stop strings count from the min_tokens-th token on, as EOS does (vLLM's rule)
        check = request.stop_matcher.feed(delta,
                                          match=request.num_output_tokens >= params.min_tokens)
        text, reason, matched = check.text, None, check.matched
        if matched is not None:
            reason = FinishReason.STOP
        elif (request.num_output_tokens >= params.max_tokens
              or request.num_tokens >= self.max_model_len):
            drained = self._drain(request)
            text += drained.text
            reason = FinishReason.STOP if drained.matched else FinishReason.LENGTH
            matched = drained.matched
        token = TokenOutput(token_id, request.num_output_tokens - 1, text, sampled.logprob,
                            sampled.top_logprobs)
        if reason is None:
            return GenerationStep(request.request_id, token, None)
        step = self._finish(request, reason, now, matched=matched)
        return GenerationStep(request.request_id, token, step.completion)

    def _prompt_done(self, request: Request, now: float) -> GenerationStep:
        """A max_tokens 0 request's end, once its prompt is computed: with its pooled vector
        when it embeds."""
        request.first_token_time = now
        step = self._finish(request, FinishReason.LENGTH, now)
        if request.params.pooling is not None:
            step = dataclasses.replace(step, embedding=pooled_vector(request))
        return step

    @staticmethod
    def _with_prompt_logprobs(request: Request, step: GenerationStep) -> GenerationStep:
        """The request's first step after its prompt: it carries the prompt's logprobs."""
        request.prompt_logprobs_sent = True
        entries = (None, *request.prompt_logprobs) if request.num_prompt_tokens else ()
        return dataclasses.replace(step, prompt_logprobs=entries)

    @staticmethod
    def _drain(request: Request) -> StopCheck:
        """Release the text held back at the end: incomplete UTF-8 and a partial stop string
        (unless the released text completes a stop string)."""
        held = request.stop_matcher.feed(request.detokenizer.flush())
        if held.matched:
            return held
        return StopCheck(held.text + request.stop_matcher.flush(), None)

    def _fail(self, request: Request, message: str) -> GenerationStep:
        return self._finish(request, FinishReason.ERROR, time.perf_counter(), error=message)

    def _finish(self, request: Request, reason: FinishReason, now: float,
                matched: str | int | None = None, tail: str = "",
                error: str | None = None) -> GenerationStep:
        self.scheduler.remove(request)
        del self._requests[request.request_id]
        self.runner.release(request.request_id)
        timing = RequestTiming(
            arrival=request.arrival_time,
            first_scheduled=request.first_scheduled_time or now,
            first_token=request.first_token_time or now,
            finish=now)
        completion = Completion(reason, request.num_prompt_tokens, request.num_output_tokens,
                                timing, tail, matched, error, request.cached_prompt_tokens)
        return GenerationStep(request.request_id, None, completion)
