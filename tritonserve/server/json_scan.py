"""A small JSON scanner for tool calls being written (server/tool_parsers.py): over the text
so far, where each call object starts, its `name` once complete, where its arguments start
and end, where it ends, and whether the text went wrong. A Scanner keeps its state between
deltas and reads each character once: scanning the whole call text again at each delta cost
6.1 s of event-loop time for 8,000 tokens of arguments (quadratic)."""
from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"


@dataclass
class CallScan:
    """One call object as far as its text goes (offsets into the scanned text)."""

    start: int
    name: str | None = None
    first_key: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_string: bool = False  # arguments written as a JSON string holding the JSON
    end: int | None = None


@dataclass
class Scan:
    calls: list[CallScan]
    error: bool = False
    end: int | None = None  # where the calls' region ended (text after it is not a call)


class Scanner:
    """Call objects at nesting `call_depth` (1: top-level objects; 2: objects in an array), fed
    the text in pieces; `feed` returns the scan of everything fed so far. Once the text went
    wrong or the calls' region ended, later pieces change nothing."""

    def __init__(self, call_depth: int = 1, separators: str = "") -> None:
        self.call_depth, self.separators = call_depth, separators
        self.text = ""
        self.calls: list[CallScan] = []
        self.stack: list[list] = []  # [bracket, state, key, value_start]
        self.in_string, self.escape, self.string_start = False, False, 0
        self.current: CallScan | None = None
        self.final: Scan | None = None  # an error, or the end of the calls' region

    def feed(self, piece: str) -> Scan:
        if self.final is None:
            start = len(self.text)
            self.text += piece
            self.final = self._run(start)
        if self.final is not None:
            return self.final
        return Scan(self.calls + ([self.current] if self.current is not None else []))

    def _value_start(self, i: int, is_string: bool) -> None:
        stack, current = self.stack, self.current
        frame = stack[-1] if stack else None
        if frame is None or frame[0] != "{" or frame[1] != "value":
            return
        frame[3] = i
        if current is not None and len(stack) == self.call_depth and frame[2] in ARGUMENT_KEYS:
            current.args_start, current.args_string = i, is_string

    def _value_end(self, end: int) -> None:
        stack, current = self.stack, self.current
        frame = stack[-1] if stack else None
        if frame is None or frame[0] != "{" or frame[3] is None:
            return
        if current is not None and len(stack) == self.call_depth:
            raw = self.text[frame[3]:end]
            if frame[2] == "name" and raw.startswith('"'):
                current.name = json.loads(raw)
            elif frame[2] in ARGUMENT_KEYS:
                current.args_end = end
        frame[1], frame[3] = "comma", None

    def _run(self, start: int) -> Scan | None:
        """Scans text[start:]; a Scan when the scan has ended for good."""
        text, stack, call_depth, calls = self.text, self.stack, self.call_depth, self.calls
        for i in range(start, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    frame = stack[-1] if stack else None
                    if frame is not None and frame[0] == "{" and frame[1] == "key":
                        frame[2], frame[1] = json.loads(text[self.string_start:i + 1]), "colon"
                        if self.current is not None and len(stack) == call_depth:
                            self.current.first_key = self.current.first_key or frame[2]
                    else:
                        self._value_end(i + 1)
                continue
            if ch in _WHITESPACE:
                continue
            if not stack:
                if ch in self.separators:
                    continue
                if ch != ("[" if call_depth == 2 else "{"):
                    return Scan(calls, end=i) if calls else Scan(calls, error=True)
            if ch == '"':
                self._value_start(i, True)
                self.in_string, self.string_start = True, i
            elif ch in "{[":
                self._value_start(i, False)
                stack.append([ch, "key" if ch == "{" else "value", None, None])
                if ch == "{" and len(stack) == call_depth:
                    self.current = CallScan(i)
            elif ch in "}]":
                if not stack or stack[-1][0] != ("{" if ch == "}" else "["):
                    return Scan(calls, error=True)
                closing = stack.pop()
                if closing[0] == "{" and closing[3] is not None:  # a primitive value ended
                    stack.append(closing)
                    self._value_end(i)
                    stack.pop()
                if ch == "}" and len(stack) == call_depth - 1 and self.current is not None:
                    self.current.end = i + 1
                    calls.append(self.current)
                    self.current = None
                self._value_end(i + 1)
                if not stack and call_depth == 2:  # the array of calls closed
                    return Scan(calls, end=i + 1)
            elif ch == ":":
                if not stack or stack[-1][1] != "colon":
                    return Scan(calls, error=True)
                stack[-1][1] = "value"
            elif ch == ",":
                if stack and stack[-1][0] == "{":
                    self._value_end(i)
                    stack[-1][1] = "key"
            elif stack and stack[-1][0] == "{" and stack[-1][1] == "value" \
                    and stack[-1][3] is None:
                self._value_start(i, False)  # a number, true, false or null
        return None


def scan(text: str, call_depth: int = 1, separators: str = "") -> Scan:
    """The whole text at once (a closed region, a test)."""
    return Scanner(call_depth, separators).feed(text)
