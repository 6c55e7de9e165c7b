"""Errors that a user can act on."""


class RingserveError(Exception):
    """Base class of ringserve's own errors."""


class ModelLoadError(RingserveError):
    """The model folder, file, config or a weight is missing, unsupported or malformed."""


class RequestError(RingserveError, ValueError):
    """A request that cannot be served as given (too long, bad parameters)."""
