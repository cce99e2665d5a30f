"""The project's error types for input a user got wrong.

train.py, sweep.py and inference.py show these as one line naming the
culprit (exit code 2); any other exception is a bug and keeps its traceback.
They subclass ValueError so that library-style callers may catch them as such.
"""


class UserError(ValueError):
    """Input a user got wrong; the message names the culprit and, where there is one, the fix."""


class ConfigError(UserError):
    """A config field, flag or sweep file: unknown, of the wrong type, or an impossible value."""


class DataError(UserError):
    """A data file, built dataset or vocabulary: missing, empty, malformed or inconsistent."""


class CheckpointError(UserError):
    """A checkpoint to restore: missing, unreadable, or not matching the run's config."""


class WorkdirInUse(UserError):
    """Another run is training in the workdir (it holds the workdir's lock)."""


class NonFiniteLoss(UserError):
    """Training diverged; the message names the step and the last good checkpoint."""
