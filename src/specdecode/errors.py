"""User-facing errors: each carries a one-line message naming the problem."""


class SpecDecodeError(Exception):
    """Base class; the CLI prints these as ``error: <message>`` and exits non-zero."""


class ConfigError(SpecDecodeError, ValueError):
    """A setting is out of range or inconsistent (k < 1, top_p > 1, unknown method...)."""


class ModelLoadError(SpecDecodeError):
    """A model path is missing, unreadable or of an unsupported kind."""


class IncompatibleDraftError(SpecDecodeError):
    """The draft's vocabulary does not match the target's."""


class InputError(SpecDecodeError, ValueError):
    """A request is malformed: empty prompt, oversized request, bad JSON."""


class QueueFullError(SpecDecodeError):
    """The engine's queue of waiting requests is at its configured limit; try again later."""
