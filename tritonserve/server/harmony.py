"""gpt-oss's harmony format (`--reasoning-parser openai_gptoss`, picked from a template that
writes `<|channel|>`): the output is a run of messages, each a header, `<|message|>`, a body and
an end token, and this file turns them into what the chat APIs send, while it streams:

    <|channel|>analysis<|message|>We need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

- channel `analysis`: reasoning_content;
- channel `final`, a `commentary` message with no recipient (a preamble), or one with no
  channel: content;
- a message with a recipient (`to=functions.NAME`, in the header before or after the channel)
  when the request has tools: a tool call NAME whose arguments are the body, streamed as the
  model writes it; without tools, the body is reasoning (it was not written for the user).

The generation prompt ends with `<|start|>assistant`, so the output begins inside a header. The
text must keep the special tokens (the chat route decodes this output with
skip_special_tokens=False); a marker split across deltas is held back until it is decided. A
model that never writes a header (no `<|message|>` in its first HEADER_LIMIT characters) is
all content. `<|return|>` and `<|call|>` are end-of-sequence tokens (generation_config), so the
text seldom holds them; after one, as after `<|end|>`, the next `<|start|>` opens a message.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from tritonserve.engine.reasoning_end import partial_suffix

from .tool_parsers import ToolCall

PARSER = "openai_gptoss"  # vLLM's name for the reasoning parser; the tool parser is "openai"
TOOL_PARSER = "openai"
START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
FINAL_OPENS = CHANNEL + "final" + MESSAGE  # where a response_format's grammar takes over
HEADER_LIMIT = 256  # a header longer than this is not one: the output is plain text
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def is_harmony(template: str | None) -> bool:
    return bool(template) and CHANNEL in template and MESSAGE in template


@dataclass
class HarmonyDeltas:
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)  # OpenAI delta.tool_calls entries


class HarmonyStream:
    """Feed the output's text deltas in order; each call returns what may be sent now."""

    def __init__(self, tools: bool, single: bool = False) -> None:
        self.tools, self.single = tools, single
        self.calls: list[ToolCall] = []  # finished calls, in order
        self._held = ""
        self._state = "header"  # header | body | between (after an end, before <|start|>)
        self._kind = ""  # the open body's field: reasoning | content | call | drop
        self._call: ToolCall | None = None  # the open call (its arguments so far)
        self._announced = 0  # calls whose name was sent
        self._structured = False  # a header was seen: this is harmony, not plain text
        self._said = {"reasoning": False, "content": False}  # a message of the field began

    def feed(self, text: str) -> HarmonyDeltas:
        out = HarmonyDeltas()
        self._held += text
        while self._held:
            if self._state == "between":
                cut = self._held.find(START)
                if cut < 0:  # nothing belongs between messages: drop all but a marker's start
                    self._held = self._held[len(self._held) - partial_suffix(self._held, START):]
                    break
                self._held, self._state = self._held[cut + len(START):], "header"
                continue
            if self._state == "header":
                cut = self._held.find(MESSAGE)
                if cut < 0:
                    if not self._structured and len(self._held) > HEADER_LIMIT:
                        self._state, self._kind = "body", "content"  # not harmony at all
                        continue
                    break
                self._open(self._held[:cut], out)
                self._held = self._held[cut + len(MESSAGE):]
                continue
            cut, marker = min(((self._held.find(m), m) for m in ENDS if m in self._held),
                              default=(-1, ""))
            if cut >= 0:
                self._body(self._held[:cut], out)
                self._held = self._held[cut + len(marker):]
                self._close()
                continue
            keep = max(partial_suffix(self._held, m) for m in ENDS)
            self._body(self._held[:len(self._held) - keep], out)
            self._held = self._held[len(self._held) - keep:]
            break
        return out

    def finish(self) -> HarmonyDeltas:
        """The output ended: an open body keeps what was held; an open call is finished."""
        out = HarmonyDeltas()
        held, self._held = self._held, ""
        if self._state == "body":
            self._body(held, out)
            self._close()
        elif self._state == "header" and not self._structured:
            self._kind = "content"  # plain text that never became a header
            self._body(held, out)
        return out

    # ---- messages ------------------------------------------------------------------------
    def _open(self, header: str, out: HarmonyDeltas) -> None:
        self._structured, self._state = True, "body"
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        channel = channel.group(1) if channel else ""
        if recipient is not None:
            self._kind = "call" if self.tools else "reasoning"
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"
        if self._kind == "call":
            name = recipient.group(1)
            name = name[len("functions."):] if name.startswith("functions.") else name
            self._call = ToolCall(name, "")
            if self.single and self._announced:
                self._kind = "drop"  # parallel_tool_calls false: the first call only
                return
            out.calls.append({"index": self._announced, "id": self._call.id,
                              "type": "function", "function": {"name": name, "arguments": ""}})
            self._announced += 1
        elif self._said[self._kind]:  # a second message of the same field: a paragraph apart
            setattr(out, self._kind, getattr(out, self._kind) + "\n\n")
        if self._kind in self._said:
            self._said[self._kind] = True

    def _body(self, text: str, out: HarmonyDeltas) -> None:
        if not text or self._kind == "drop":
            return
        if self._kind == "call":
            self._call = ToolCall(self._call.name, self._call.arguments + text, self._call.id)
            out.calls.append({"index": self._announced - 1, "function": {"arguments": text}})
        else:
            setattr(out, self._kind, getattr(out, self._kind) + text)

    def _close(self) -> None:
        if self._kind == "call":
            self.calls.append(self._call)
        self._call, self._kind, self._state = None, "", "between"
