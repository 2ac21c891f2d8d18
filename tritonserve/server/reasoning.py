"""Reasoning parsers (`--reasoning-parser qwen3|deepseek_r1`): a chat completion's text split
into `reasoning_content` and `content` at the end-of-thinking tag, as vLLM's parsers do, while
it streams.

- qwen3: the output is reasoning when the prompt left a `<think>` open (the template opened it)
  or when the output starts with `<think>`; otherwise it is all content (Qwen3's template with
  enable_thinking=False writes an empty `<think></think>` into the prompt).
- deepseek_r1: the output is reasoning until `</think>` (DeepSeek-R1's template opens the tag
  in the prompt, and the model may also write it).

A tag split across tokens, or inside one token's text with other text around it, is found:
the splitter holds back the few characters that could still begin a tag. An output that never
closes the tag (max_tokens) is all reasoning; one that starts without it (qwen3) all content.
"""
from __future__ import annotations

from dataclasses import dataclass

# the tags, and the rule for a tag split across deltas, are the engine's too (its grammar
# hand-off after the reasoning): engine/reasoning_end.py
from tritonserve.engine.reasoning_end import END, START, partial_suffix
PARSERS = ("qwen3", "deepseek_r1")


def pick_parser(template: str | None) -> str | None:
    """The parser a chat template asks for, where that is unambiguous: Qwen3's template
    handles `enable_thinking`; DeepSeek-R1's opens `<think>` in the generation prompt."""
    if not template or END not in template:
        return None
    if "enable_thinking" in template:
        return "qwen3"
    if "<｜Assistant｜>" in template:
        return "deepseek_r1"
    return None


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class ReasoningSplitter:
    """Feed the output's text deltas in order; each call returns what may be sent now."""

    def __init__(self, parser: str, prompt_text: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {PARSERS}, got {parser!r}")
        opened = prompt_text.rfind(START) > prompt_text.rfind(END)
        self.parser = parser
        self.reasoning = opened or parser == "deepseek_r1"
        self.undecided = not self.reasoning  # qwen3: does the output open the tag itself?
        self.done = False  # past the end tag: everything is content
        self._held = ""
        self._leading = True  # at the output's start (whitespace before <think> allowed)
        self._after_end = False  # right after </think>, before any content

    @property
    def may_reason(self) -> bool:
        """Before any output: the output may open with reasoning."""
        return self.reasoning or self.undecided

    def feed(self, text: str) -> Split:
        out = Split()
        self._held += text
        while self._held:
            if self.done:
                if self._after_end:  # the newlines after </think> belong to neither field
                    self._held = self._held.lstrip("\n")
                    self._after_end = not self._held
                out.content += self._held
                self._held = ""
                break
            if self.undecided:
                stripped = self._held.lstrip()
                if stripped.startswith(START):
                    self._held = stripped[len(START):]
                    self.undecided, self.reasoning, self._leading = False, True, False
                    continue
                if START.startswith(stripped):  # could still become <think>
                    break
                self.undecided, self.done = False, True
                continue
            if self._leading:  # reasoning from the prompt: the model may write <think> too
                stripped = self._held.lstrip()
                if stripped.startswith(START):
                    self._held = stripped[len(START):]
                elif START.startswith(stripped):
                    break
                self._leading = False
                continue
            cut = self._held.find(END)
            if cut >= 0:
                out.reasoning += self._held[:cut]
                self._held = self._held[cut + len(END):]
                self.done = self._after_end = True
                continue
            keep = partial_suffix(self._held, END)
            out.reasoning += self._held[:len(self._held) - keep]
            self._held = self._held[len(self._held) - keep:]
            break
        return out

    def finish(self) -> Split:
        """The end of the output: what was held back goes where it stood."""
        held, self._held = self._held, ""
        if self.reasoning and not self.done:
            return Split(reasoning=held)
        return Split(content=held)

    def split_all(self, text: str) -> Split:
        """A whole (non-streamed) output."""
        first, last = self.feed(text), self.finish()
        return Split(first.reasoning + last.reasoning, first.content + last.content)

