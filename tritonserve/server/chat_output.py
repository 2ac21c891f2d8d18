"""One chat choice's text as OpenAI sends it: the reasoning split off first
(server/reasoning.py), then tool calls parsed out of what is left (server/tool_parsers.py);
or, for gpt-oss's harmony format, both from its channels (server/harmony.py).
Streamed, each text delta becomes a `delta` with whichever of `reasoning_content`, `content`
and `tool_calls` it produced; whole, the text becomes the `message`. The streamed deltas
joined equal the whole message (tests/test_chat_features.py checks it), except for a tool
call the model broke after its name was sent (then the rest of its text is dropped, where the
whole message is all content).
"""
from __future__ import annotations

from . import harmony
from .reasoning import ReasoningSplitter, Split
from .tool_parsers import ToolCallStream
from .tools import ToolPlan


class ChatOutput:
    def __init__(self, reasoning_parser: str | None, prompt_text: str,
                 plan: ToolPlan | None) -> None:
        self.harmony = (harmony.HarmonyStream(plan is not None and plan.mode != "none",
                                              plan is not None and plan.single)
                        if reasoning_parser == harmony.PARSER else None)
        self.splitter = (ReasoningSplitter(reasoning_parser, prompt_text)
                         if reasoning_parser and self.harmony is None else None)
        self.tools: ToolCallStream | None = (plan.stream() if plan is not None
                                             and self.harmony is None else None)
        self.has_calls = False

    # ---- streamed --------------------------------------------------------------------------
    def delta(self, text: str) -> dict:
        if self.harmony is not None:
            return self._wire(self.harmony.feed(text))
        split = self.splitter.feed(text) if self.splitter else Split(content=text)
        return self._delta(split, final=False)

    def final_delta(self, tail_text: str) -> dict:
        if self.harmony is not None:
            first, last = self.harmony.feed(tail_text), self.harmony.finish()
            return self._wire(harmony.HarmonyDeltas(first.reasoning + last.reasoning,
                                                    first.content + last.content,
                                                    first.calls + last.calls))
        if self.splitter:
            first, last = self.splitter.feed(tail_text), self.splitter.finish()
            split = Split(first.reasoning + last.reasoning, first.content + last.content)
        else:
            split = Split(content=tail_text)
        return self._delta(split, final=True)

    def _delta(self, split: Split, final: bool) -> dict:
        delta: dict = {}
        if split.reasoning:
            delta["reasoning_content"] = split.reasoning
        content, calls = split.content, []
        if self.tools is not None:
            parsed = self.tools.feed(content)
            if final:
                last = self.tools.finish()
                parsed.content += last.content
                parsed.calls += last.calls
            content, calls = parsed.content, parsed.calls
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = _merged(calls)
            self.has_calls = True
        return delta

    def _wire(self, parsed: harmony.HarmonyDeltas) -> dict:
        delta: dict = {}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.calls:
            delta["tool_calls"] = _merged(parsed.calls)
            self.has_calls = True
        return delta

    # ---- whole -----------------------------------------------------------------------------
    def message(self, text: str) -> dict:
        """The assistant message of a whole output (a fresh ChatOutput per output)."""
        message: dict = {"role": "assistant"}
        if self.harmony is not None:
            whole = self.final_delta(text)
            message["reasoning_content"] = whole.get("reasoning_content")
            message["content"] = whole.get("content")
            if self.harmony.calls:
                message["tool_calls"] = [c.wire() for c in self.harmony.calls]
            return message
        if self.splitter:
            split = self.splitter.split_all(text)
            message["reasoning_content"] = split.reasoning or None
            text = split.content
        if self.tools is None:
            message["content"] = text if not self.splitter else text or None
            return message
        content, calls = self.tools.parse_all(text)
        message["content"] = content
        if calls:
            message["tool_calls"] = [c.wire() for c in calls]
            self.has_calls = True
        return message


def _merged(calls: list[dict]) -> list[dict]:
    """One entry per call in a delta (a call's name and its first arguments can come out of
    one token): clients merge entries of one index across chunks, not within one."""
    out: list[dict] = []
    for call in calls:
        if out and out[-1]["index"] == call["index"]:
            last = out[-1]
            function = {**last["function"], "arguments": last["function"]["arguments"]
                        + call["function"]["arguments"]}
            out[-1] = {**last, "function": function}
        else:
            out.append(call)
    return out
