"""A small JSON scanner for tool calls being written (server/tool_parsers.py): over the text
so far, where each call object starts, its `name` once complete, where its arguments start
and end, where it ends, and whether the text went wrong. Calls are short, so the parser scans
the whole call text again at each delta instead of keeping scanner state."""
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


def scan(text: str, call_depth: int = 1, separators: str = "") -> Scan:
    """Call objects at nesting `call_depth` (1: top-level objects; 2: objects in an array)."""
    calls: list[CallScan] = []
    stack: list[list] = []  # [bracket, state, key, value_start]; state: key / colon / value
    in_string, escape, string_start = False, False, 0
    current: CallScan | None = None

    def value_start(i: int, is_string: bool) -> None:
        frame = stack[-1] if stack else None
        if frame is None or frame[0] != "{" or frame[1] != "value":
            return
        frame[3] = i
        if current is not None and len(stack) == call_depth and frame[2] in ARGUMENT_KEYS:
            current.args_start, current.args_string = i, is_string

    def value_end(end: int) -> None:
        frame = stack[-1] if stack else None
        if frame is None or frame[0] != "{" or frame[3] is None:
            return
        if current is not None and len(stack) == call_depth:
            raw = text[frame[3]:end]
            if frame[2] == "name" and raw.startswith('"'):
                current.name = json.loads(raw)
            elif frame[2] in ARGUMENT_KEYS:
                current.args_end = end
        frame[1], frame[3] = "comma", None

    for i, ch in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
                frame = stack[-1] if stack else None
                if frame is not None and frame[0] == "{" and frame[1] == "key":
                    frame[2], frame[1] = json.loads(text[string_start:i + 1]), "colon"
                    if current is not None and len(stack) == call_depth:
                        current.first_key = current.first_key or frame[2]
                else:
                    value_end(i + 1)
            continue
        if ch in _WHITESPACE:
            continue
        if not stack:
            if ch in separators:
                continue
            if ch != ("[" if call_depth == 2 else "{"):
                return Scan(calls, end=i) if calls else Scan(calls, error=True)
        if ch == '"':
            value_start(i, True)
            in_string, string_start = True, i
        elif ch in "{[":
            value_start(i, False)
            stack.append([ch, "key" if ch == "{" else "value", None, None])
            if ch == "{" and len(stack) == call_depth:
                current = CallScan(i)
        elif ch in "}]":
            if not stack or stack[-1][0] != ("{" if ch == "}" else "["):
                return Scan(calls, error=True)
            closing = stack.pop()
            if closing[0] == "{" and closing[3] is not None:  # a primitive value ended
                stack.append(closing)
                value_end(i)
                stack.pop()
            if ch == "}" and len(stack) == call_depth - 1 and current is not None:
                current.end = i + 1
                calls.append(current)
                current = None
            value_end(i + 1)
            if not stack and call_depth == 2:  # the array of calls closed
                return Scan(calls, end=i + 1)
        elif ch == ":":
            if not stack or stack[-1][1] != "colon":
                return Scan(calls, error=True)
            stack[-1][1] = "value"
        elif ch == ",":
            if stack and stack[-1][0] == "{":
                value_end(i)
                stack[-1][1] = "key"
        elif stack and stack[-1][0] == "{" and stack[-1][1] == "value" and stack[-1][3] is None:
            value_start(i, False)  # a number, true, false or null
    if current is not None:
        calls.append(current)  # still being written
    return Scan(calls)
