"""Errors a user can cause, each with a message that names the problem and the fix.

Everything zinf raises on bad input derives from :class:`ZinfError`, so a caller (and the CLI,
which prints ``str(error)`` on one line and exits non-zero) can catch one class.
"""

from __future__ import annotations


class ZinfError(Exception):
    """Base class of every error zinf raises on purpose. ``str(err)`` is a one-line message."""


class ConfigError(ZinfError, ValueError):
    """The configuration has an unknown key, a wrong type, or values that contradict each other."""


class StorageError(ZinfError, OSError):
    """``nvme_path`` (or a checkpoint directory) is missing, not a directory, read-only or full."""


class BudgetError(ZinfError):
    """The placement needs more DRAM (or GPU memory) than the configured budget allows."""


class CorruptShardError(ZinfError):
    """A shard or checkpoint file failed its checksum or header check."""


class CheckpointError(ZinfError):
    """A checkpoint directory is missing, incomplete, or does not match the model."""


class ModelError(ZinfError):
    """The model cannot be wrapped as given (e.g. it has no parameters, or uses a parameter outside
    the forward of a module that owns it)."""


class ProfileError(ZinfError):
    """The profile database cannot be opened or migrated, or a run id is unknown."""
