"""Streaming-safe incremental detokenization and stop-string matching.

Two rules make the text honest by construction:
- bytes of an incomplete UTF-8 character are held back (the token's delta is "") and released
  with the token that completes them, so U+FFFD is never emitted for a split character;
- text that might be the start of a stop string is held back and released as soon as it
  cannot be, so nothing after a stop string is ever emitted.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"


def plain_decode(tokenizer) -> Callable[[list[int], bool], str] | None:
    """The `tokenizers` decode a transformers fast tokenizer runs for
    `decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=False)`, when its class
    changes nothing on that path; else None (the tokenizer's own decode then serves). The
    same text without transformers' per-call conversions: 0.54 vs 2.18 us a call for SmolLM2,
    two calls a token (~0.2 ms of a batch-64 step; docs/perf-log/2026-cpu-decode.md)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its decode
        return None
    kind = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or kind._decode is not TokenizersBackend._decode
            or kind.decode is not PreTrainedTokenizerBase.decode):
        return None
    backend = tokenizer.backend_tokenizer
    return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    """Turns output token ids into text deltas whose concatenation equals the output's
    in-context decode: `decode(prompt + output)` less `decode(prompt)`.

    It decodes a short window (the previous chunk plus the new tokens) and diffs it against the
    previous chunk alone, so tokenizers that strip a leading space at the start of a decode
    (SentencePiece / Metaspace) still produce the right delta, and each step costs O(window),
    not O(output). The window starts on the last few prompt tokens (`prompt_context`), so the
    first output token keeps the space it has in context.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 prompt_context: list[int] | tuple[int, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._plain = plain_decode(tokenizer)
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_context)
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # ids before this have been released as text

    def _decode(self, ids: list[int]) -> str:
        if self._plain is not None:
            return self._plain(ids, self._skip_special)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing complete yet: an unfinished character, or an invisible token
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Text still held when the request ends (incomplete UTF-8 decodes to U+FFFD here,
        exactly as tokenizer.decode would show it)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]


@dataclass(frozen=True)
class StopCheck:
    text: str  # what may be released now
    matched: str | None  # the stop string that matched, if any


class StopStringMatcher:
    """Finds stop strings across token boundaries, holding back only a possible prefix."""

    def __init__(self, stop: tuple[str, ...], include_stop_in_output: bool) -> None:
        self._stop = stop
        self._include = include_stop_in_output
        self._held = ""

    def feed(self, delta: str, match: bool = True) -> StopCheck:
        """match=False (before min_tokens): release everything, look for nothing."""
        if not self._stop:
            return StopCheck(delta, None)
        buffer = self._held + delta
        if not match:
            self._held = ""
            return StopCheck(buffer, None)
        match_at, matched = -1, None
        for stop in self._stop:
            at = buffer.find(stop)
            if at != -1 and (match_at == -1 or at < match_at):
                match_at, matched = at, stop
        if matched is not None:
            self._held = ""
            end = match_at + (len(matched) if self._include else 0)
            return StopCheck(buffer[:end], matched)
        hold = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return StopCheck(buffer[:len(buffer) - hold], None)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        longest = min(len(buffer), max(len(s) for s in self._stop) - 1)
        for size in range(longest, 0, -1):
            tail = buffer[-size:]
            if any(stop.startswith(tail) for stop in self._stop):
                return size
        return 0
