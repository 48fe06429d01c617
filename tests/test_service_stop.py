"""``tilert-submit stop S`` on a service directory whose cells are real ``--local --mock`` jobs:
the front is signalled once proven to be the one service.json names, every cell still running is
stopped through its job directory, and no process of the service is left (docs/service.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import psutil

from agent.service.paths import ServiceDir
from agent.service.records import CellRecord, ServiceStatus
from tests import kit

READY_S = 60.0
# A stand-in for the service front: it exits on SIGTERM without stopping any cell (as a front
# that stopped in a hurry would), so whatever stop S leaves running shows.
FRONT = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "print('front up', flush=True)\n"
    "time.sleep(600)\n"
)


def test_stop_s_stops_the_front_and_every_cell_and_leaves_no_process(tmp_path: Path) -> None:
    service = ServiceDir(tmp_path / "S")
    service.cells.mkdir(parents=True)
    cells: list[kit.LocalJob] = []
    front = subprocess.Popen(
        [sys.executable, "-c", FRONT, "serve", str(service.root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for name in ("cell-1", "cell-2"):
            sets, _ = kit.isolated_sets(None)
            cells.append(kit.LocalJob(service.cell(name).root, sets).__enter__())
        records = []
        for job in cells:
            status = job.wait_state("ready", timeout=READY_S)
            job.remember_tree()
            records.append(
                CellRecord(
                    name=job.job.name,
                    state="ready",
                    local_pid=status["local_pid"],
                    local_started_at=status["local_started_at"],
                    front_url=status["front_url"],
                    decodes=2,
                )
            )
        assert front.stdout is not None
        assert front.stdout.readline() == "front up\n"
        record = ServiceStatus(
            state="serving",
            name="svc",
            front_url="http://127.0.0.1:1",
            front_pid=front.pid,
            front_started_at=psutil.Process(front.pid).create_time(),
            backend="local",
            cells=records,
        )
        service.status.write_bytes(msgspec.json.encode(record))
        done = subprocess.run(
            [*kit.SUBMIT, "stop", str(service.root)],
            cwd=kit.REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        assert f"stopping the service front: SIGTERM to pid {front.pid}" in out, out
        assert "service stopped: 2 cell(s), none running" in out, out
        assert "Traceback" not in out, out
        assert front.wait(10) == 0
        for job in cells:
            assert job.wait_exit(30) == 0, job.output()
            assert job.status()["state"] == "stopped"
            kit.assert_gone(list(job.seen.values()), 10)
            kit.assert_nothing_left(job.job, 10)
    finally:
        front.kill()
        front.wait(5)
        if front.stdout is not None:
            front.stdout.close()
        for job in cells:
            job.__exit__(None, None, None)
