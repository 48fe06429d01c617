"""``tilert-submit serve`` without starting a service (submit/serve.py): the dry run shows the
service plan and one cell's plan and writes nothing; a bad service key exits 2 naming it; the
front lock refuses a second front (naming its pid) and takes over one left by a dead front;
squeue's line read as the Slurm launcher reads it."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import msgspec
import pytest

from agent.node.folderlock import LockInfo
from agent.service.launcher import CellFacts
from agent.service.paths import ServiceDir
from submit.cli import main
from submit.serve import hold_lock
from submit.servecells import squeue_facts
from submit.slurm import client
from tests.kit.commands import DEMO_RECIPE

# A pid no process has (near the kernel's highest): the front that held the lock is gone.
NO_SUCH_PID = 4_194_301


def test_the_dry_run_shows_the_service_and_a_cell_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sdir = tmp_path / "S"
    sets = ["--set", "slurm.time_limit='2:00:00'", "--set", "service.cells=2"]
    code = main(
        ["serve", str(DEMO_RECIPE), "--mock", "--service-dir", str(sdir), "--dry-run", *sets]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"Service directory: {sdir}" in out
    assert "cells: 2 (at most 3 at once during a succession)" in out
    assert "cells' time limit: 7200 s; successor lead: auto; drain: 60 s" in out
    assert "cell-1" in out
    assert out.rstrip().endswith("Dry run: nothing started.")
    assert not sdir.exists()


def test_a_bad_service_key_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["serve", str(DEMO_RECIPE), "--mock", "--service-dir", str(tmp_path / "S")]
    code = main([*args, "--dry-run", "--set", "service.max_cells=1", "--set", "service.cells=2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "service.max_cells" in err
    assert "Traceback" not in err


def _lock(sdir: ServiceDir, pid: int) -> None:
    """The lock as a front with ``pid`` on this host left it (a killed one leaves it so)."""
    info = LockInfo(
        token="t", agent="service-front", node=socket.gethostname(), job=str(sdir.root),
        pid=pid, temp="", started_at=0.0,
    )  # fmt: skip
    sdir.lock.write_bytes(msgspec.json.encode(info))


def test_a_live_front_is_refused_a_dead_one_taken_over(tmp_path: Path) -> None:
    sdir = ServiceDir(tmp_path)
    _lock(sdir, os.getpid())
    refused = hold_lock(sdir)
    assert isinstance(refused, str)
    assert f"pid {os.getpid()} on {socket.gethostname()}" in refused
    assert "tilert-submit stop" in refused
    sdir.lock.unlink()
    _lock(sdir, NO_SUCH_PID)
    held = hold_lock(sdir)
    assert not isinstance(held, str)
    held.release()
    assert not sdir.lock.exists()


@pytest.mark.parametrize(
    ("line", "running", "left", "reason"),
    [
        ("RUNNING|2:35|None", True, 155.0, None),
        ("RUNNING|1:02:03|None", True, 3723.0, None),
        ("RUNNING|1-00:00:10|None", True, 86410.0, None),
        ("RUNNING|UNLIMITED|None", True, None, None),
        ("PENDING|3:00|Resources", True, None, "Resources"),
        ("PENDING|3:00|Dependency", True, None, "Dependency"),
        ("COMPLETED|0:00|None", False, None, None),
        ("", False, None, None),
    ],
)
def test_squeue_says_running_time_left_and_pending_reason(
    monkeypatch: pytest.MonkeyPatch,
    line: str,
    running: bool,
    left: float | None,
    reason: str | None,
) -> None:
    """One ``squeue -o %T|%L|%r`` line read as the keeper needs it (Slurm's time formats)."""

    def squeue(argv: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        assert argv[:4] == ["squeue", "-h", "-j", "42"]
        return subprocess.CompletedProcess(argv, 0, line + "\n", "")

    monkeypatch.setattr(client, "run_client", squeue)
    assert squeue_facts("42") == CellFacts(running=running, time_left_s=left, pending_reason=reason)


def test_squeue_unreachable_is_unknown_and_a_forgotten_job_is_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def down(_argv: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        raise client.SlurmError("squeue did not answer within 10 s: is slurmctld up?")

    monkeypatch.setattr(client, "run_client", down)
    assert squeue_facts("42").running is None

    def forgot(_argv: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        raise client.SlurmError("squeue failed (exit 1): slurm_load_jobs error: Invalid job id")

    monkeypatch.setattr(client, "run_client", forgot)
    assert squeue_facts("42").running is False
