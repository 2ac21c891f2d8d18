class InvalidRequestError(ValueError):
    """A request the engine refuses before enqueueing it; `param` names the culprit."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message
