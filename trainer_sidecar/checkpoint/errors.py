"""The errors of the checkpoint package."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """The checkpoint directory or a checkpoint in it cannot be used; the message names the path."""
