"""Structured output: a request's grammar (JSON schema, any JSON, regex, a choice of strings,
or EBNF) as a token bitmask applied to its logits before the draw, with xgrammar (the grammar
library vLLM and SGLang use by default).

Contract: a grammar is made in three steps, each of which raises InvalidRequestError(spec.param)
naming the request's field:
- `Grammars.check(spec)`: the bounds of engine/limits.py (text size, schema depth), linear in
  the text; cheap enough for the event loop;
- `parse(spec)`: the spec as an xgrammar Grammar, which needs no tokenizer; the part whose time
  grows with a schema's depth (a 128-level schema: ~0.2 s); its `serialize_json()` is small
  (80 KB at 128 levels) and crosses to a data-parallel engine process;
- `Grammars.compile(grammar)`: the token masks over the vocabulary (a CompiledGrammar, 0.1-50
  MB: never sent between processes); the part whose time grows with a choice list's length.
Both slow steps release the GIL: the server runs them on a worker thread
(server/grammar_jobs.py), never on the event loop, and hands the engine what they made; the
engine does not compile the text again. `matcher(compiled)` gives a request its own matcher;
the sampler's TokenBitmask fills and applies the masks of a batch; the engine calls
`accept_token` with every sampled token and finishes the request when the matcher is
terminated. A grammar's only way out is the tokenizer's EOS: when the grammar is complete, EOS
is the only token left.
"""
from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .errors import InvalidRequestError
from .limits import RequestLimits, json_depth


def _xgrammar():
    """Imported on first use: an engine that never sees a grammar never loads it."""
    import xgrammar
    return xgrammar

KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_OBJECT = '{"type": "object"}'  # what json_object means: OpenAI's and vLLM's
# xgrammar caches compiled grammars by content without a bound by default: distinct grammars
# from clients would grow it for ever (one 480-level schema compiled to 48 MB)
CACHE_BYTES = 256 << 20


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


def _bad(spec: StructuredOutput, exc: Exception) -> InvalidRequestError:
    return InvalidRequestError(spec.param, f"{spec.param} does not compile: "
                               f"{type(exc).__name__}: {exc}")


def check(spec: StructuredOutput, limits: RequestLimits) -> None:
    """The bounds of engine/limits.py, before any work that grows faster than the text."""
    if len(spec.value) > limits.max_grammar_chars:
        raise InvalidRequestError(spec.param, f"{spec.param} is {len(spec.value)} characters; "
                                  f"at most {limits.max_grammar_chars} (--max-grammar-chars)")
    if spec.kind == "json":
        try:
            depth = json_depth(json.loads(spec.value), limits.max_schema_depth)
        except (ValueError, RecursionError) as exc:
            raise _bad(spec, exc) from None
        if depth > limits.max_schema_depth:
            raise InvalidRequestError(spec.param, f"{spec.param} is nested more than "
                                      f"{limits.max_schema_depth} levels deep "
                                      "(--max-schema-depth)")


def parse(spec: StructuredOutput):
    """-> an xgrammar Grammar (no tokenizer needed)."""
    xgr = _xgrammar()
    try:
        if spec.kind in ("json", "json_object"):  # json_object: an object at the top,
            # anything inside (vLLM's rule; xgrammar's builtin JSON grammar took any value)
            schema = spec.value if spec.kind == "json" else JSON_OBJECT
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c)
                                                                   for c in choices))
        return xgr.Grammar.from_ebnf(spec.value)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises several types for bad input
        raise _bad(spec, exc) from None


def from_json(text: str):
    """A parsed Grammar back from its serialize_json() (a data-parallel engine's side)."""
    return _xgrammar().Grammar.deserialize_json(text)


class Grammars:
    """One per engine: the compiler, built for its tokenizer, with xgrammar's (bounded) cache.
    One compile thread: on a 2-core machine the engine keeps the other core."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1,
                                            cache_limit_bytes=CACHE_BYTES)

    def compile(self, grammar, spec: StructuredOutput):
        """A parsed Grammar -> an xgrammar CompiledGrammar (errors name spec's field)."""
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises several types for bad input
            raise _bad(spec, exc) from None

    def compile_spec(self, spec: StructuredOutput):
        """parse then compile, in the calling thread (a grammar worker, the offline API)."""
        return self.compile(parse(spec), spec)

    @staticmethod
    def matcher(compiled):
        """-> a fresh xgrammar GrammarMatcher for one request."""
        return _xgrammar().GrammarMatcher(compiled)


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
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
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
