"""Errors a user can cause. Each carries a message naming the bad input and what is accepted."""


class VerispecError(Exception):
    """Base class for user-facing errors (bad flags, bad model paths, bad request fields)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ModelNotFoundError(VerispecError):
    """A model id resolved to no local directory and could not be downloaded."""


class UnsupportedModelError(VerispecError):
    """The checkpoint uses an architecture or feature verispec does not implement yet."""


class InvalidRequestError(VerispecError):
    """A generation request with out-of-range or contradictory parameters."""


class EngineUnavailableError(VerispecError):
    """The engine can no longer run requests (its process died): the server answers 503."""
