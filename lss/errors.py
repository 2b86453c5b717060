"""User errors: what the user asked for or supplied cannot work, and the message says what to
change.

The command line prints these in one line (exit code 2); any other exception is a bug and keeps its
traceback.
"""


class LssError(Exception):
    """Base of the user errors."""


class ConfigError(LssError, ValueError):
    """A configuration value or key is not valid; the message names the key, the value and what is
    allowed."""


class ArgumentError(LssError, ValueError):
    """A command-line argument (or the function argument it feeds) is out of its range."""


class DatasetError(LssError):
    """The dataset on disk cannot serve the request (missing tables, splits, images or channels)."""


class CheckpointError(LssError, RuntimeError):
    """A checkpoint file is missing, unreadable or does not fit the model."""


class RunDirInUseError(LssError):
    """Another live process trains into the run directory (it holds the directory's lock)."""


class ResourceError(LssError):
    """The machine lacks what the run needs (device memory); the message says what to lower."""


class ProcessGroupError(LssError, RuntimeError):
    """Another process of a torchrun run ended or cannot be reached; the message says where the
    run stopped and which checkpoint to resume from."""
