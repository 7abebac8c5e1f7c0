"""Typed errors. Library code raises these; `rlctl.cli` maps them to exit codes in one place.

`InputError` and its subclasses mean the user gave something bad (exit code 2, one line on
stderr, nothing written). Any other `RlctlError` is a failure of the run itself (exit code 1).
"""

from __future__ import annotations


class RlctlError(Exception):
    """A failure rlctl can explain in one line (exit code 1)."""

    exit_code = 1


class InputError(RlctlError):
    """Bad usage or bad input: a file, column, key or value the user supplied (exit code 2)."""

    exit_code = 2


class SchemaError(InputError):
    """A table that does not match its Arrow schema contract."""


class SchemaVersionError(SchemaError):
    """Data written by a newer major schema version than this rlctl reads."""


class ConfigError(InputError):
    """A TOML config, `--set` override or flag value that is not valid."""


class NotCommittedError(InputError):
    """An output folder without `_manifest.json`: a write that never finished."""


class RewardError(InputError):
    """A reward function that raised, timed out, or returned something unusable."""


class TrainingError(RlctlError):
    """Training went wrong in a way that must not be committed (a non-finite gradient)."""
