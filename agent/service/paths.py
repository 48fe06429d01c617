"""The service directory layout (docs/service.md): one place that knows every path in ``S/``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.job.paths import JobDir


@dataclass(frozen=True)
class ServiceDir:
    """Paths inside one service directory."""

    root: Path

    @property
    def recipe(self) -> Path:
        """``recipe.yaml``: the recipe every cell is submitted with (overrides applied)."""
        return self.root / "recipe.yaml"

    @property
    def status(self) -> Path:
        """``service.json``: the service's state and its cells (``agent.service.records``)."""
        return self.root / "service.json"

    @property
    def lock(self) -> Path:
        """``front.lock``: held by the one service front serving this directory."""
        return self.root / "front.lock"

    @property
    def log(self) -> Path:
        """``service.log``: the service front's own log (successions, replacements, adoptions)."""
        return self.root / "service.log"

    @property
    def targets(self) -> Path:
        """``targets.json``: one Prometheus file_sd list covering the front and every cell."""
        return self.root / "targets.json"

    @property
    def cells(self) -> Path:
        """``cells/``: one ordinary job directory per cell, named ``cell-N`` (N never reused)."""
        return self.root / "cells"

    def cell(self, name: str) -> JobDir:
        """The job directory of cell ``name``."""
        return JobDir(self.cells / name)

    @staticmethod
    def is_service(path: Path) -> bool:
        """Whether ``path`` is a service directory (it holds ``service.json``), not a job's."""
        return (path / "service.json").is_file()
