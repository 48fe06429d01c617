"""``tilert-submit --help``, ``status J`` and ``--dry-run`` of 1 prefill + 64 decode, each beside a
bare interpreter start (``python -c pass``, the floor every command pays)."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from agent.job.paths import JobDir
from tests.bench.procs import PY, REPO, submit, timed
from tests.bench.results import Figure

DEMO = REPO / "recipes" / "local-demo.yaml"
SIXTY_FOUR = ["--set", "roles.decode.nodes=64", "--set", "roles.decode.workers=64"]
FLOOR = "python -c pass (interpreter start)"


def _ready_job(root: Path) -> Path:
    """A job directory whose status.json says ``ready``, run by a live local supervisor."""
    job = root / "status-job"
    timed(submit(str(DEMO), "--mock", "--local", "--dry-run", "--job-dir", str(job)))
    jd = JobDir(job)
    status = jd.read_status()
    status = msgspec.structs.replace(
        status, state="ready", local_pid=os.getpid(), updated_at=time.time()
    )
    jd.write_status(status)
    return job


def measure(names: set[str], *, quick: bool) -> list[Figure]:
    """The CLI figures among ``names``, each run several times beside the floor."""
    runs = 5 if quick else 15
    figures = []
    with tempfile.TemporaryDirectory(prefix="tilert-bench-cli-") as tmp:
        root = Path(tmp)
        job = _ready_job(root) if "cli_status_ms" in names else None

        def dry_run(i: int) -> list[str]:
            job_dir = str(root / f"dry-{i}")
            return submit(
                str(DEMO), "--mock", "--local", "--dry-run", *SIXTY_FOUR, "--job-dir", job_dir
            )

        commands: dict[str, Callable[[int], list[str]]] = {
            "cli_help_ms": lambda _i: submit("--help"),
            "cli_status_ms": lambda _i: submit("status", str(job)),
            "dry_run_64_decode_ms": dry_run,
        }
        for name, argv in commands.items():
            if name not in names:
                continue
            timed(argv(-1))  # warm: .pyc files and the page cache, as for a user's second run
            ours, floor = [], []
            for i in range(runs):  # interleaved: both see the machine at the same moment
                floor.append(timed([PY, "-c", "pass"]) * 1000)
                ours.append(timed(argv(i)) * 1000)
            figures.append(Figure(name, ours, FLOOR, floor))
    return figures
