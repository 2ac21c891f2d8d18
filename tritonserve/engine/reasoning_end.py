"""Where a reasoning model's thinking ends: the text `</think>` in its output. One rule for
both places that need it: the engine hands a structured request's grammar over once its
detokenized output holds the tag (SamplingParams.structured_after; llm_engine.py), and the
server splits reasoning_content from content at it (server/reasoning.py). Both read the same
text, and a tag split across tokens is found by both (partial_suffix holds back its start).
"""
from __future__ import annotations

START, END = "<think>", "</think>"


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class TagFinder:
    """Feed an output's text deltas in order; feed answers True at the delta that completes
    `tag` (which may have begun in earlier deltas)."""

    def __init__(self, tag: str = END) -> None:
        if not tag:
            raise ValueError("tag must be a non-empty string")
        self.tag = tag
        self._tail = ""

    def feed(self, text: str) -> bool:
        joined = self._tail + text
        if self.tag in joined:
            self._tail = ""
            return True
        self._tail = joined[len(joined) - partial_suffix(joined, self.tag):]
        return False
