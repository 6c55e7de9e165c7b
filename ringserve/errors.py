"""Errors that a user can act on."""


class RingserveError(Exception):
    """Base class of ringserve's own errors."""


class ModelLoadError(RingserveError):
    """The model folder, file, config or a weight is missing, unsupported or malformed."""


class MeasurementRejected(RingserveError):
    """A measured setting that contradicts the table it was derived from: it is not saved."""


class RequestError(RingserveError, ValueError):
    """A request that cannot be served as given (too long, bad parameters)."""


class RequestTooLargeError(RequestError, MemoryError):
    """A request that needs more KV-cache blocks than the whole cache has: it fails alone."""

    def __init__(self, message: str, request_id: str):
        super().__init__(message)
        self.request_id = request_id


class RequestFailedError(RingserveError):
    """A request that failed inside a step (finish_reason "error"); the others went on."""


# What building an engine raises for a bad option, model or device, or too little memory:
# the commands report it as one `error: ...` line and exit 2; anything else is a bug and
# keeps its traceback.
ENGINE_START_ERRORS = (RingserveError, ValueError, NotImplementedError, MemoryError)
