"""Every bound on a request's input whose cost grows with it, in one place: the engine's checker
(engine/request_check.py) and the server's routes read them, `tritonserve serve` turns each
field into a flag (`--max-stop` ...; its help is the field's), and docs/protocol.md ("Limits")
lists them. A request past one gets a 400 naming the field, before any work that grows with it.

Why each is needed (each measured against the embedded model on a 2-core machine):
- stop strings are matched against every token's text: 370k of them cost ~0.14 s of engine
  time a token, and a 40-token neighbour went from 0.18 s to 6.2 s;
- grammars compile in time that grows faster than their text: a 480-level nested schema
  (31 KB) took 22 s, 20,000 choices (580 KB) 28 s; 64 levels take ~40 ms, 64 KB of choices
  ~0.1 s;
- message lists and tools are rendered by the chat template: 120k empty messages held the
  tokenizer worker 6.5 s.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields


def _limit(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class RequestLimits:
    max_stop: int = _limit(64, "stop strings a request (OpenAI allows 4)")
    max_stop_chars: int = _limit(512, "characters of one stop string")
    max_stop_token_ids: int = _limit(1024, "stop_token_ids entries a request")
    max_logit_bias: int = _limit(1024, "logit_bias entries a request (OpenAI allows 300)")
    max_grammar_chars: int = _limit(
        64 * 1024, "characters of a structured-output spec: a JSON schema, regex, EBNF "
        "grammar or the choices of guided_choice together")
    max_schema_depth: int = _limit(64, "JSON nesting depth of a JSON schema (its compile "
                                   "time grows faster than the square of its depth)")
    grammar_timeout: float = _limit(10.0, "seconds a grammar may take to compile (off the "
                                    "event loop) before the request gets a 400")
    max_messages: int = _limit(2048, "chat messages a request")
    max_tools: int = _limit(128, "tools a request (OpenAI's limit)")
    max_tools_chars: int = _limit(64 * 1024, "characters of a request's tools, as JSON")

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be > 0, got {getattr(self, f.name)}")

    def over_count(self, field_name: str, count: int) -> str | None:
        """The 400's message when a COUNTED field has more entries than its limit allows."""
        limit = getattr(self, COUNTED[field_name])
        if count <= limit:
            return None
        return (f"{field_name} has {count} entries; at most {limit} "
                f"(--{COUNTED[field_name].replace('_', '-')})")


# request fields with a bounded number of entries, and their limits: checked on the parsed
# JSON before the body's schema validation too (pydantic took 310 ms for 120k messages)
COUNTED = {"stop": "max_stop", "stop_token_ids": "max_stop_token_ids",
           "logit_bias": "max_logit_bias", "messages": "max_messages", "tools": "max_tools"}


def json_depth(value, limit: int) -> int:
    """The nesting depth of a parsed JSON value, counting no further than limit + 1 (so a
    deep value costs no more than a shallow one past the limit). Iterative: no recursion
    error on a deep value."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        children = item.values() if isinstance(item, dict) else item
        todo.extend((child, depth + 1) for child in children)
    return deepest
