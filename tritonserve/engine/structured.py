"""Structured output: a request's grammar (JSON schema, any JSON, regex, a choice of strings,
or EBNF) as a token bitmask applied to its logits before the draw, with xgrammar (the grammar
library vLLM and SGLang use by default).

Contract: `Grammars.compile(spec)` raises InvalidRequestError(spec.param) for a grammar that
does not compile (call it when the request is validated; compiled grammars are cached by
xgrammar, so compiling again when the request is added costs nothing). `matcher(spec)` gives a
request its own matcher; the sampler's TokenBitmask fills and applies the masks of a batch;
the engine calls `accept_token` with every sampled token and finishes the request when the matcher
is terminated. A grammar's only way out is the tokenizer's EOS: when the grammar is complete,
EOS is the only token left.
"""
from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .errors import InvalidRequestError


def _xgrammar():
    """Imported on first use: an engine that never sees a grammar never loads it."""
    import xgrammar
    return xgrammar

KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_OBJECT = '{"type": "object"}'  # what json_object means: OpenAI's and vLLM's


@dataclass(frozen=True)
class StructuredOutput:
    """kind: json (value = a JSON schema as text), json_object (any JSON object), regex,
    choice (value = JSON list of strings), grammar (EBNF). param names the request field it
    came from, for errors."""

    kind: str
    value: str = ""
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(self.param, f"{self.param} must be one of {KINDS}, "
                                      f"got {self.kind!r}")


class Grammars:
    """One per engine: the compiler, built for its tokenizer, with xgrammar's cache."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info)

    def compile(self, spec: StructuredOutput):
        """-> an xgrammar CompiledGrammar."""
        try:
            if spec.kind == "json":
                return self.compiler.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "json_object":  # an object at the top, anything inside (vLLM's
                # rule; xgrammar's builtin JSON grammar took any value: arrays, strings)
                return self.compiler.compile_json_schema(JSON_OBJECT, any_whitespace=False)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                choices = json.loads(spec.value)
                alternatives = " | ".join(json.dumps(c) for c in choices)
                return self.compiler.compile_grammar(f"root ::= {alternatives}")
            return self.compiler.compile_grammar(spec.value)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises several types for bad input
            raise InvalidRequestError(spec.param, f"{spec.param} does not compile: "
                                      f"{type(exc).__name__}: {exc}") from None

    def matcher(self, spec: StructuredOutput):
        """-> a fresh xgrammar GrammarMatcher for one request."""
        return _xgrammar().GrammarMatcher(self.compile(spec))


class TokenBitmask:
    """The sampler's bitmask buffer: one packed row per batch row, [B, ceil(V / 32)] int32.
    fill() starts filling on a worker thread, so the model runner can start it before the
    forward and the fills (2-4 % of a batch-64 CPU step, `tritonserve bench grammar`) overlap
    the forward; apply() waits for them. One fill is in flight at a time."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask: torch.Tensor | None = None  # allocated at the first structured batch
        self._worker: ThreadPoolExecutor | None = None

    def fill(self, matchers: list) -> Future | None:
        """matchers: one per batch row, None for rows without a grammar. None when no row
        has one."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        batch = len(matchers)
        if self._bitmask is None or self._bitmask.shape[0] < batch:
            self._bitmask = _xgrammar().allocate_token_bitmask(batch, self.vocab_size)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        return self._worker.submit(_fill, [matchers[i] for i in rows], rows,
                                   self._bitmask[:batch])

    def apply(self, logits: torch.Tensor, filled: Future | None) -> None:
        """In place: logits [B, V] rows that have a grammar keep only the tokens it allows."""
        if filled is None:
            return
        bitmask, rows = filled.result()
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        _xgrammar().apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def _fill(matchers: list, rows: list[int], bitmask: torch.Tensor):
    for matcher, row in zip(matchers, rows):
        matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask, rows


def choice_spec(choices: list[str], param: str) -> StructuredOutput:
    if not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequestError(param, f"{param} must be a non-empty list of strings")
    return StructuredOutput("choice", json.dumps(choices), param)
