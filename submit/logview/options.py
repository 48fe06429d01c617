"""What ``tilert-submit logs`` was asked to read: the same for every source, local or remote."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Options:
    """``--follow``, ``--agent``, ``--tail N``, ``--since`` (Unix seconds), ``--timestamps``."""

    follow: bool = False
    agent: bool = False
    tail: int | None = None
    since: float | None = None
    timestamps: bool = False

    @property
    def rotated(self) -> bool:
        """Whether the history starts with the rotated files (not with ``--tail``)."""
        return self.tail is None
