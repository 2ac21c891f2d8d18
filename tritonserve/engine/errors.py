"""Errors that cross the engine's boundary."""


class InvalidRequestError(ValueError):
    """A request the engine refuses before enqueueing it; `param` names the culprit, and the
    text always begins with that name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message if message.startswith(param) else f"{param}: {message}")
        self.param = param
        self.message = message


class EngineDeadError(RuntimeError):
    """The engine cannot step any more (a device fault, or steps that keep failing). `steps`
    are the GenerationSteps the failing step produced before it died: deliver them, then end
    every other request."""

    def __init__(self, message: str, steps: list | None = None) -> None:
        super().__init__(message)
        self.steps = steps or []


class NoTokenAllowedError(RuntimeError):
    """A request's own rules forbid every token of the vocabulary at this step (a grammar, a
    min_tokens ban over its stop_token_ids): that request alone ends with an error, naming the
    conflict; its neighbours go on. The sampler never draws a forbidden token instead."""
