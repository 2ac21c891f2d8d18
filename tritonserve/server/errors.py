"""The server's one exception for an HTTP error (imports nothing of the server, so any file
may raise it; app.json_errors turns it into the JSON body)."""
from __future__ import annotations


class ApiError(Exception):
    """Becomes an HTTP error with a JSON body, always before any SSE byte is sent."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param
