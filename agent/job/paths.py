"""The job directory layout (docs/cli.md): one place that knows every path and mode in ``J/``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from agent.job.records import JobStatus

# Set by every agent for the processes it starts (engines, the router): the job directory that
# owns a process, read back by the node check that finds processes of ended jobs.
JOB_DIR_ENV = "TILERT_JOB_DIR"
DIR_MODE = 0o711
PRIVATE_DIR_MODE = 0o700
PROMETHEUS_DIR_MODE = 0o755


@dataclass(frozen=True)
class JobDir:
    """Paths inside one job directory; creating them is ``create``'s job, reading is everyone's."""

    root: Path

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def sbatch(self) -> Path:
        return self.root / "sbatch.sh"

    @property
    def token(self) -> Path:
        return self.root / "token"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    @property
    def pool(self) -> Path:
        """``pool.json``: the decode pool ``tilert-submit scale`` asks for (agent.job.pool)."""
        return self.root / "pool.json"

    @property
    def pool_lock(self) -> Path:
        """``pool.lock``: held by ``tilert-submit scale`` while it changes ``pool.json``."""
        return self.root / "pool.lock"

    @property
    def rendezvous(self) -> Path:
        return self.root / "rendezvous"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def prometheus(self) -> Path:
        return self.root / "prometheus"

    @property
    def targets(self) -> Path:
        return self.prometheus / "targets.json"

    def record(self, name: str) -> Path:
        """The rendezvous record of agent ``name``."""
        return self.rendezvous / f"{name}.json"

    def log_dir(self, name: str) -> Path:
        """The log folder of agent ``name`` (``engine.log``, ``agent.log``, ``router.log``)."""
        return self.logs / name

    def read_token(self) -> str:
        """The job's bearer token for protected routes."""
        return self.token.read_text().strip()

    def read_status(self) -> JobStatus:
        """Decode ``status.json``."""
        return msgspec.json.decode(self.status.read_bytes(), type=JobStatus)

    def write_status(self, status: JobStatus) -> None:
        """Write ``status.json`` atomically, 0644."""
        # Imported by the writers only: `tilert-submit status` reads this file and must not pay
        # for tempfile and shutil (docs/performance.md, "CLI imports").
        from agent.job.atomicfile import write_atomic

        write_atomic(self.status, msgspec.json.encode(status), mode=0o644)

    def create(self) -> None:
        """Lay out an empty job directory with the modes docs/cli.md lists; the root must not exist
        or be
        empty."""
        # Imported where a job is created: secrets (hashlib, OpenSSL) and tempfile are a
        # submission's cost, not every reader's (docs/performance.md, "CLI imports").
        import secrets

        from agent.job.atomicfile import write_atomic

        if self.root.exists() and any(self.root.iterdir()):
            raise FileExistsError(f"{self.root} exists and is not empty")
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, DIR_MODE)
        for sub, mode in (
            (self.rendezvous, PRIVATE_DIR_MODE),
            (self.logs, PRIVATE_DIR_MODE),
            (self.prometheus, PROMETHEUS_DIR_MODE),
        ):
            sub.mkdir()
            os.chmod(sub, mode)
        write_atomic(self.token, secrets.token_urlsafe(32).encode() + b"\n", mode=0o600)
        write_atomic(self.targets, b"[]\n", mode=0o644)
