"""What makes a request admissible, checked before it is queued: the prompt's length and token
ids, max_tokens within max_model_len, the sampling parameters against the vocabulary, the
bounds of engine/limits.py. It reads configuration only, so the data-parallel front end
(server/dp_engine.py) checks requests itself, with no engine in its process. Every check is
linear in the request and bounded (the event loop runs it); a grammar's compile is not one of
them: engine/structured.py's parse and compile run where the host puts them
(server/grammar_jobs.py: a worker thread), and `compile` here is the offline API's.
"""
from __future__ import annotations

import functools

from .errors import InvalidRequestError
from .limits import RequestLimits
from .sampling_params import SamplingParams
from .structured import Grammars, check


class RequestChecker:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 max_model_len: int, limits: RequestLimits = RequestLimits()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.limits = limits

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Built on the first structured request (it reads the whole vocabulary once)."""
        return Grammars(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Raise InvalidRequestError for a request that could never run; return its
        parameters checked against the vocabulary (SamplingParams.for_vocab)."""
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        room = 0 if params.max_tokens == 0 else 1  # scoring or embedding a prompt: none
        if len(prompt_token_ids) + room > self.max_model_len:  # before any per-token work
            raise InvalidRequestError(
                "prompt", f"{len(prompt_token_ids)} tokens leave no room for output within "
                f"max_model_len {self.max_model_len}")
        vocab = self.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= vocab
               for t in prompt_token_ids):
            raise InvalidRequestError("prompt", f"token ids must be in [0, {vocab})")
        self._check_bounds(params)
        params = params.for_vocab(vocab)
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens", f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                f"({params.max_tokens}) = {total} exceeds max_model_len {self.max_model_len}")
        # No KV-block check here: max_model_len fits the cache (resolve_max_model_len), so a
        # request is admitted by what it needs now, and a full cache preempts (scheduler.py).
        return params

    def _check_bounds(self, params: SamplingParams) -> None:
        limits = self.limits
        for name in ("stop", "stop_token_ids", "logit_bias"):
            problem = limits.over_count(name, len(getattr(params, name)))
            if problem is not None:
                raise InvalidRequestError(name, problem)
        longest = max(map(len, params.stop), default=0)
        if longest > limits.max_stop_chars:
            raise InvalidRequestError("stop", f"a stop string is {longest} characters; at most "
                                      f"{limits.max_stop_chars} (--max-stop-chars)")
        spec = params.structured
        if spec is None:
            return
        check(spec, limits)
        if params.min_tokens:  # a complete grammar allows EOS alone, which min_tokens bans
            raise InvalidRequestError("min_tokens", f"min_tokens cannot be combined with "
                                      f"{spec.param}: a grammar ends the output with EOS once "
                                      "it is complete, and min_tokens forbids EOS until then")

    def compile(self, params: SamplingParams):
        """The request's grammar compiled here (None without one): for callers with no
        worker to run it on (the offline API)."""
        spec = params.structured
        return None if spec is None else self.grammars.compile_spec(spec)
