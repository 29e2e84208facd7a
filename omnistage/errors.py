"""Errors that carry an HTTP status, so every layer can reject bad input the same way."""

from __future__ import annotations


class OmniError(Exception):
    """Base for errors a caller can act on. `status` is the HTTP status the server answers."""

    status: int = 500
    type: str = "internal_error"

    def __init__(self, message: str, param: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status


class RequestError(OmniError, ValueError):
    """The request is malformed or asks for something this deployment cannot do (4xx)."""

    status = 400
    type = "invalid_request_error"


class StageError(OmniError):
    """A stage failed while serving a request (5xx); the message names the stage."""

    status = 500
    type = "stage_error"


class ConfigError(OmniError, ValueError):
    """The model path or deploy config cannot be served; raised at start-up."""

    status = 500
    type = "config_error"


def stage_failure(stage: str, scope: str = "this request") -> str:
    """What a caller is told when `stage` failed unexpectedly: the stage, never the exception (its type, text and
    the addresses in it are for the server log, which gets the traceback)."""
    return f"stage {stage!r} failed on {scope}; the server log has the details"
