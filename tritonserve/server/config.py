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

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.grace_period < 0:
            raise ValueError(f"grace_period must be >= 0, got {self.grace_period}")
