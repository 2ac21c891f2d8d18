"""A chat choice's output as a sequence of typed blocks (reasoning, text, one per tool call),
which is how the Messages API (content blocks) and the Responses API (output items) both
stream. BlockStream reads the deltas a ChatOutput produces (server/chat_output.py) and says
when a block opens, grows and closes; the two dialects only name those moments
(server/messages_api.py, server/responses_api.py). Blocks never interleave: a block closes
before the next opens, and every opened block is closed by finish().
"""
from __future__ import annotations

from dataclasses import dataclass, field

REASONING, TEXT, TOOL = "reasoning", "text", "tool"


@dataclass
class Block:
    index: int  # position among the choice's blocks, from 0
    kind: str  # REASONING | TEXT | TOOL
    text: str = ""  # the reasoning or text so far; a tool call's arguments so far
    call_id: str = ""  # TOOL: the call's id
    name: str = ""  # TOOL: the function's name


@dataclass(frozen=True)
class BlockEvent:
    what: str  # "start" | "delta" | "stop"
    block: Block
    delta: str = ""  # "delta": the text added


@dataclass
class BlockStream:
    blocks: list[Block] = field(default_factory=list)
    _open: Block | None = None
    _calls: dict[int, Block] = field(default_factory=dict)  # tool_calls index -> its block

    def feed(self, delta: dict) -> list[BlockEvent]:
        """One ChatOutput delta (reasoning_content, content, tool_calls) -> events."""
        events: list[BlockEvent] = []
        if delta.get("reasoning_content"):
            self._grow(REASONING, delta["reasoning_content"], events)
        if delta.get("content"):
            self._grow(TEXT, delta["content"], events)
        for call in delta.get("tool_calls") or ():
            block = self._calls.get(call["index"])
            function = call.get("function") or {}
            if block is None:
                block = self._start(TOOL, events)
                block.call_id, block.name = call.get("id") or "", function.get("name") or ""
                self._calls[call["index"]] = block
            arguments = function.get("arguments") or ""
            if arguments:
                block.text += arguments
                events.append(BlockEvent("delta", block, arguments))
        return events

    def finish(self) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        self._close(events)
        return events

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def _grow(self, kind: str, text: str, events: list[BlockEvent]) -> None:
        block = self._open if self._open is not None and self._open.kind == kind \
            else self._start(kind, events)
        block.text += text
        events.append(BlockEvent("delta", block, text))

    def _start(self, kind: str, events: list[BlockEvent]) -> Block:
        self._close(events)
        block = Block(len(self.blocks), kind)
        self.blocks.append(block)
        self._open = block
        events.append(BlockEvent("start", block))
        return block

    def _close(self, events: list[BlockEvent]) -> None:
        if self._open is not None:
            events.append(BlockEvent("stop", self._open))
            self._open = None


def blocks_of(message: dict) -> list[Block]:
    """A whole chat message (ChatOutput.message) as blocks, in the order a stream gives them."""
    stream = BlockStream()
    stream.feed({"reasoning_content": message.get("reasoning_content"),
                 "content": message.get("content")})
    for i, call in enumerate(message.get("tool_calls") or ()):
        stream.feed({"tool_calls": [{"index": i, **call}]})
    stream.finish()
    return stream.blocks
