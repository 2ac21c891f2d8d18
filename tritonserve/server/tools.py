"""Tool calling for /v1/chat/completions: `tools` + `tool_choice` -> a ToolPlan that says what
the engine must enforce and how the output becomes `tool_calls`.

- "none": the tools go to the chat template; the output is plain content.
- "auto" (the default when tools are given): the tools go to the chat template and the output
  is parsed, as it streams, in the format the template writes (server/tool_parsers.py: hermes,
  llama3_json, mistral); text outside the calls is the content.
- "required" and a named function: the output is forced by a grammar (so this works on any
  model): a named call's output is its arguments object (its `parameters` schema); a required
  call's output is {"name": one of the tools, "arguments": its parameters}. Their arguments
  stream as they are written too.

`parallel_tool_calls: false` keeps the first call (a forced call is one call by its grammar).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from tritonserve.engine.structured import StructuredOutput

from .common import ApiError
from .tool_parsers import ToolCallStream

_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: tuple[dict, ...]  # the OpenAI tool definitions, for the chat template
    name: str | None = None  # the named function
    parser: str = "hermes"  # auto's format (tool_parsers.PARSERS)
    single: bool = False  # parallel_tool_calls: false

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

    def stream(self) -> ToolCallStream | None:
        """A parser for one choice's output; None when the output is plain content."""
        if self.mode == "none":
            return None
        fmt = self.parser if self.mode == "auto" else self.mode
        return ToolCallStream(fmt, self.single, self.name)


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


def tool_plan(tools: list[dict] | None, tool_choice, parser: str = "hermes",
              parallel_tool_calls: bool | None = None) -> ToolPlan | None:
    """None when the request involves no tools."""
    if not tools:
        if tool_choice in (None, "none", "auto"):
            return None
        raise ApiError(400, "invalid_request", "tool_choice needs tools", "tool_choice")
    tools = _check_tools(tools)
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolPlan(tool_choice or "auto", tools, None, parser,
                        parallel_tool_calls is False)
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict) \
            and isinstance(tool_choice["function"].get("name"), str):
        plan = ToolPlan("named", tools, tool_choice["function"]["name"], parser)
        plan._parameters(plan.name)  # a name that is not in tools is a 400 now
        return plan
    raise ApiError(400, "invalid_request", "tool_choice must be none, auto, required or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
