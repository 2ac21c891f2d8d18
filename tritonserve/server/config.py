"""Server options: one frozen dataclass whose defaults the command line reads (no default is
written twice), next to the engine's configs (engine/config.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting: int = 256  # waiting requests beyond this get HTTP 503 at once
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get HTTP 413
    grace_period: float = 10.0  # seconds SIGTERM lets running streams finish
    # server/operators.py: the key every route but the probes wants (none: open)
    api_key: str | None = None
    auth_probes: bool = False  # the key guards /health, /metrics and /version too
    allowed_origins: tuple[str, ...] = ()  # CORS; "*" for any
    served_model_name: tuple[str, ...] = ()  # the names requests may use; the first is reported
    # server/watchdog.py: a step older than this ends the engine (None: auto; 0: off)
    step_timeout: float | None = None
    # server/chat_template.py: a template file replacing the tokenizer's, and the seconds a
    # render may take; server/reasoning.py and server/tool_parsers.py: "auto" = what the
    # template asks for
    chat_template: str | None = None
    chat_template_timeout: float = 5.0
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    # server/dp_engine.py: engine processes behind this front end, and how it picks one
    # (server/router.py's POLICIES)
    data_parallel_size: int = 1
    data_parallel_routing: str = "prefix"
    # server/responses_api.py: Responses kept in memory for GET and previous_response_id
    # (least recently used dropped first)
    responses_store: int = 1024
    # server/routes_lora.py: POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer
    allow_runtime_lora: bool = False

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_body_bytes", "data_parallel_size", "responses_store"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.step_timeout is not None and self.step_timeout < 0:
            raise ValueError(f"step_timeout must be >= 0 (0: off), got {self.step_timeout}")
        if self.chat_template_timeout <= 0:
            raise ValueError(f"chat_template_timeout must be > 0, got "
                             f"{self.chat_template_timeout}")
        if self.grace_period < 0:
            raise ValueError(f"grace_period must be >= 0, got {self.grace_period}")
