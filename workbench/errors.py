"""The package's own error type.

Every problem a user can cause (a missing file, a truncated checkpoint, a wrong tensor shape,
an unsupported architecture, a bad sampling parameter) is raised as :class:`WorkbenchError`
with a message that names *what* and *where* and, where possible, how to fix it.  The CLI
prints that message and exits non-zero without a traceback; anything else is a bug.
"""


class WorkbenchError(Exception):
    """A user-facing error: the message names the file / tensor / field and what was expected."""


class ConfigError(WorkbenchError, ValueError):
    """A configuration value (config.json field, dataclass field, CLI flag) is invalid."""


class CheckpointError(WorkbenchError):
    """A checkpoint folder or file is missing, truncated or does not match its config."""


class TokenizerError(WorkbenchError):
    """The tokenizer is missing or cannot be read."""


class DataError(WorkbenchError, ValueError):
    """A data file (a calibration or evaluation JSONL) cannot be read: the message names the
    file and the line."""
