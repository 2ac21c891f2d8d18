"""What makes a request admissible, checked before it is queued: the prompt's length and token
ids, max_tokens within max_model_len, the sampling parameters against the vocabulary, a
structured-output grammar that compiles. It reads configuration only, so the data-parallel
front end (server/dp_engine.py) checks requests itself, with no engine in its process.
"""
from __future__ import annotations

import functools

from .errors import InvalidRequestError
from .sampling_params import SamplingParams
from .structured import Grammars


class RequestChecker:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Built on the first structured request (it reads the whole vocabulary once)."""
        return Grammars(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Raise InvalidRequestError for a request that could never run; return its
        parameters checked against the vocabulary (SamplingParams.for_vocab)."""
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:  # before any per-token work
            raise InvalidRequestError(
                "prompt", f"{len(prompt_token_ids)} tokens leave no room for output within "
                f"max_model_len {self.max_model_len}")
        vocab = self.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= vocab
               for t in prompt_token_ids):
            raise InvalidRequestError("prompt", f"token ids must be in [0, {vocab})")
        params = params.for_vocab(vocab)
        if params.structured is not None:
            self.grammars.compile(params.structured)  # a bad grammar names its field
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens", f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                f"({params.max_tokens}) = {total} exceeds max_model_len {self.max_model_len}")
        # No KV-block check here: max_model_len fits the cache (resolve_max_model_len), so a
        # request is admitted by what it needs now, and a full cache preempts (scheduler.py).
        return params
