"""specd's exception types: one base class every engine and loader failure derives from.

The native module registers its `EngineError` as a subclass of `SpecdError`, so callers
catch one type whatever layer failed.
"""


class SpecdError(Exception):
    """Base of every error specd raises on purpose (bad model file, bad input, engine)."""


class ModelLoadError(SpecdError):
    """A model file is missing, truncated, corrupt or of an unsupported kind."""


class InvalidRequestError(SpecdError, ValueError):
    """Bad user input: sampling values, context overflow, unknown model names."""
