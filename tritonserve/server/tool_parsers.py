"""Tool calls in a model's text, parsed while it streams (`--tool-call-parser`):

- hermes (Qwen, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
  text around them is content;
- llama3_json (Llama 3.1+): the output starts with `{"name": ..., "parameters": {...}}` (or
  `<|python_tag|>` before it), several joined by `;`;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any content;
- and the forced forms of server/tools.py: `required` (the whole output is one
  {"name", "arguments"} object) and a named function (the whole output is its arguments).

ToolCallStream takes the content text in deltas and returns what may be sent now: content (text
outside the calls; a suffix that could begin a call's marker is held back, and so is
whitespace that might end up at either end: the content is the outside text, stripped), and
call deltas as OpenAI streams them: the first with `index`, `id`, `name` and empty arguments,
then the arguments' text in pieces as the model writes it (the model's own JSON text: the
streamed pieces joined equal the non-streamed `arguments`). A call is scanned by
server/json_scan.py's Scanner, fed each delta once (linear in the call's length).

A call the model never finished or wrote wrong: its text is content when no delta of it was
sent; a non-streamed answer with such a call is all content (never a 500).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from tritonserve.engine.reasoning_end import partial_suffix

from .json_scan import Scan, Scanner, scan

PARSERS = ("hermes", "llama3_json", "mistral")
PYTHON_TAG = "<|python_tag|>"


def pick_parser(template: str | None) -> str:
    """The format a chat template writes tool calls in (hermes when it says nothing)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if PYTHON_TAG in template or "Environment: ipython" in template:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def wire(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class Deltas:
    content: str = ""
    calls: list[dict] = field(default_factory=list)  # OpenAI delta.tool_calls entries


@dataclass
class _Region:
    """The text of one run of calls (between markers), and what was sent of its calls."""

    text: str = ""
    closed: bool = False
    announced: list[ToolCall] = field(default_factory=list)
    sent_args: list[int] = field(default_factory=list)
    scanner: Scanner | None = None  # fed region.text as it grows


class ToolCallStream:
    def __init__(self, fmt: str, single: bool = False, name: str | None = None) -> None:
        """fmt: a PARSERS entry, "required" or "named" (then `name` is the function)."""
        self.fmt, self.single, self.name = fmt, single, name
        self.start, self.end_marker, self.depth, self.separators = {
            "hermes": ("<tool_call>", "</tool_call>", 1, ""),
            "mistral": ("[TOOL_CALLS]", None, 2, ""),
            "llama3_json": (None, None, 1, ";"),
            "required": (None, None, 1, ""),
            "named": (None, None, 0, "")}[fmt]
        self._held = ""  # content text not yet decided
        self._pending_space = ""  # whitespace held until content follows it
        self._content_started = False
        self._regions: list[_Region] = []
        self._region: _Region | None = None
        self._at_start = True  # llama3_json / forced: the output's first characters decide
        self.calls: list[ToolCall] = []  # finished calls
        self.malformed = False

    # ---- feeding ---------------------------------------------------------------------------
    def feed(self, text: str) -> Deltas:
        out = Deltas()
        if self.fmt == "named":
            return self._named(text, out)
        self._held += text
        while self._held:
            if self._region is not None:
                if not self._in_region(out):
                    break
                continue
            if self._at_start and self.start is None:
                stripped = self._held.lstrip()
                if not stripped:
                    break
                if self.fmt == "llama3_json" and stripped.startswith(PYTHON_TAG):
                    self._held = stripped[len(PYTHON_TAG):]  # Llama's marker of a call
                    continue
                if self.fmt == "llama3_json" and PYTHON_TAG.startswith(stripped):
                    break
                self._at_start = False
                if stripped.startswith("{") or self.fmt == "required":
                    self._open_region(stripped)
                    continue
            self._at_start = False
            cut = self._held.find(self.start) if self.start else -1
            if cut >= 0:
                self._content(self._held[:cut], out)
                self._open_region(self._held[cut + len(self.start):])
                continue
            keep = partial_suffix(self._held, self.start) if self.start else 0
            self._content(self._held[:len(self._held) - keep], out)
            self._held = self._held[len(self._held) - keep:]
            break
        return out

    def finish(self) -> Deltas:
        """The output ended: held content goes out; a call left unfinished is reported."""
        out = Deltas()
        if self._region is not None:
            self._region.text += self._held
            self._held = ""
            self._emit(self._region, out)
            self._close_region(self._region, out)
        else:
            self._content(self._held, out)
            self._held = ""
        return out

    def parse_all(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole (non-streamed) output -> (content, calls); a malformed call: all content."""
        first, last = self.feed(text), self.finish()
        if self.malformed:
            return text, []
        content = (first.content + last.content) or None
        return content, list(self.calls)

    # ---- content ---------------------------------------------------------------------------
    def _content(self, text: str, out: Deltas) -> None:
        """Outside text: leading and trailing whitespace held until text follows it."""
        if not text:
            return
        if not self._content_started:
            text = text.lstrip()
            if not text:
                return
            self._content_started = True
        body = text.rstrip()
        if body:
            out.content += self._pending_space + body
            self._pending_space = ""
        self._pending_space += text[len(body):]

    # ---- calls -----------------------------------------------------------------------------
    def _open_region(self, rest: str) -> None:
        self._region = _Region(scanner=Scanner(self.depth, self.separators))
        self._regions.append(self._region)
        self._held = rest

    def _in_region(self, out: Deltas) -> bool:
        """Moves held text into the open region; False when more text is needed."""
        region = self._region
        if self.end_marker is not None:
            cut = self._held.find(self.end_marker)
            if cut >= 0:
                region.text += self._held[:cut]
                self._held = self._held[cut + len(self.end_marker):]
                region.closed = True
                self._emit(region, out)
                self._close_region(region, out)
                return True
            keep = partial_suffix(self._held, self.end_marker)
            region.text += self._held[:len(self._held) - keep]
            self._held = self._held[len(self._held) - keep:]
            self._emit(region, out)
            return False
        region.text += self._held
        self._held = ""
        result = self._emit(region, out)
        if result.end is not None:  # the calls ended: what follows is content again
            tail = region.text[result.end:]
            region.text = region.text[:result.end]
            self._close_region(region, out)
            self._held = tail
            return True
        return False

    def _emit(self, region: _Region, out: Deltas) -> Scan:
        result = region.scanner.feed(region.text[len(region.scanner.text):])
        for k, call in enumerate(result.calls):
            if self.single and k >= len(region.announced) and \
                    sum(len(r.announced) for r in self._regions):
                break  # parallel_tool_calls false: the first call only
            if k == len(region.announced):
                if call.name is None or call.first_key != "name":
                    break  # not known yet (or not a call: decided when the region closes)
                region.announced.append(ToolCall(call.name, ""))
                region.sent_args.append(0)
                out.calls.append({"index": self._index(region, k), "id": region.announced[k].id,
                                  "type": "function",
                                  "function": {"name": call.name, "arguments": ""}})
            if call.args_start is None or call.args_string:
                continue
            upto = call.args_end if call.args_end is not None else len(region.text)
            piece = region.text[call.args_start + region.sent_args[k]:upto]
            if piece:
                region.sent_args[k] += len(piece)
                out.calls.append({"index": self._index(region, k),
                                  "function": {"arguments": piece}})
        return result

    def _index(self, region: _Region, k: int) -> int:
        before = sum(len(r.announced) for r in self._regions if r is not region)
        return before + k

    def _close_region(self, region: _Region, out: Deltas) -> None:
        """The region ended (its end marker, the end of its calls, or of the output)."""
        self._region = None
        result = scan(region.text, self.depth, self.separators)
        whole = [c for c in result.calls if c.end is not None and c.name is not None
                 and c.args_end is not None]
        if result.error or not whole or len(whole) < len(result.calls) \
                or len(region.announced) > len(whole):
            self.malformed = True
            if not region.announced:  # nothing of it was sent as a call: it is content
                self._content((self.start or "") + region.text
                              + (self.end_marker if region.closed else ""), out)
            return
        for k, call in enumerate(whole):
            if self.single and self.calls:
                break
            arguments = region.text[call.args_start:call.args_end]
            if call.args_string:
                arguments = json.loads(arguments)
                if k < len(region.announced):
                    out.calls.append({"index": self._index(region, k),
                                      "function": {"arguments": arguments}})
            ident = region.announced[k].id if k < len(region.announced) else None
            self.calls.append(ToolCall(call.name, arguments, **({"id": ident} if ident else {})))

    def _named(self, text: str, out: Deltas) -> Deltas:
        """A named tool_choice: the whole output is the function's arguments."""
        if not self.calls:
            self.calls.append(ToolCall(self.name, ""))
            out.calls.append({"index": 0, "id": self.calls[0].id, "type": "function",
                              "function": {"name": self.name, "arguments": ""}})
        if text:
            first = self.calls[0]
            self.calls[0] = ToolCall(first.name, first.arguments + text, first.id)
            out.calls.append({"index": 0, "function": {"arguments": text}})
        return out


