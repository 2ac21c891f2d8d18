"""Tool calling for /v1/chat/completions: `tools` + `tool_choice` -> a ToolPlan that says what
the engine must enforce and how the output becomes `tool_calls`.

- "none": the tools go to the chat template; the output is plain content.
- "auto" (the default when tools are given): the tools go to the chat template and the output
  is parsed for the Hermes / Qwen format, `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`; text outside those blocks is the content.
- "required" and a named function: the output is forced by a grammar (so this works on any
  model): a named call's output is its arguments object (its `parameters` schema); a required
  call's output is {"name": one of the tools, "arguments": its parameters}.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from tritonserve.engine.structured import StructuredOutput

from .common import ApiError

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def wire(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: tuple[dict, ...]  # the OpenAI tool definitions, for the chat template
    name: str | None = None  # the named function

    def _parameters(self, name: str) -> dict:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or _ANY_OBJECT
        raise ApiError(400, "invalid_request", f"tool_choice names {name!r}, which is not in "
                       "tools", "tool_choice")

    def structured(self) -> StructuredOutput | None:
        if self.mode == "named":
            return StructuredOutput("json", json.dumps(self._parameters(self.name)),
                                    "tool_choice")
        if self.mode == "required":
            alternatives = [{"type": "object", "additionalProperties": False,
                             "required": ["name", "arguments"],
                             "properties": {"name": {"const": t["function"]["name"]},
                                            "arguments": self._parameters(t["function"]["name"])}}
                            for t in self.tools]
            return StructuredOutput("json", json.dumps({"anyOf": alternatives}), "tool_choice")
        return None

    @property
    def buffers_output(self) -> bool:
        """Streams hold the text back and send the calls at the end."""
        return self.mode != "none"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The model's output -> (content, tool calls)."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            call = json.loads(text)
            return None, [ToolCall(call["name"], json.dumps(call["arguments"]))]
        if self.mode == "none":
            return text, []
        calls = []
        for block in _HERMES.findall(text):
            try:
                call = json.loads(block)
                calls.append(ToolCall(str(call["name"]),
                                      json.dumps(call.get("arguments", {}))))
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []  # not a well-formed call: the text is the answer
        content = _HERMES.sub("", text).strip() if calls else text
        return content or None, calls


def _check_tools(tools: list[dict]) -> tuple[dict, ...]:
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise ApiError(400, "invalid_request", "each tool must be {\"type\": \"function\", "
                           "\"function\": {\"name\": ..., \"parameters\": {...}}}", f"tools.{i}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ApiError(400, "invalid_request", "parameters must be a JSON schema object",
                           f"tools.{i}.function.parameters")
    return tuple(tools)


def tool_plan(tools: list[dict] | None, tool_choice) -> ToolPlan | None:
    """None when the request involves no tools."""
    if not tools:
        if tool_choice in (None, "none", "auto"):
            return None
        raise ApiError(400, "invalid_request", "tool_choice needs tools", "tool_choice")
    tools = _check_tools(tools)
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolPlan(tool_choice or "auto", tools)
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict) \
            and isinstance(tool_choice["function"].get("name"), str):
        plan = ToolPlan("named", tools, tool_choice["function"]["name"])
        plan._parameters(plan.name)  # a name that is not in tools is a 400 now
        return plan
    raise ApiError(400, "invalid_request", "tool_choice must be none, auto, required or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
