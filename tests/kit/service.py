"""A service under test: ``tilert-submit serve RECIPE [--local] --mock --service-dir S`` in a
session of its own (``ServeProc``), its ``service.json`` read, and everything it or its cells
started killed on exit. The cells are detached from the front (they outlive a SIGKILLed one), so
the teardown also finds them through each cell's job directory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import httpx
import msgspec
import psutil

from agent.recipe.serviceplan import ServicePlan
from tests.kit.commands import DEMO_RECIPE, REPO, SUBMIT
from tests.kit.jobdir import job_ports
from tests.kit.jobs import CLUSTER_FILE, FAST
from tests.kit.processes import job_processes, kill_all, still_alive
from tests.kit.waiting import wait_for


def service_plan(**over: object) -> ServicePlan:
    """A resolved ``service:`` section for the control plane's tests (``over`` replaces fields)."""
    base = ServicePlan(
        cells=1,
        max_cells=2,
        host="127.0.0.1",
        port=8090,
        successor_lead_s=60.0,
        drain_s=30.0,
        replace_backoff_s=10.0,
        replace_backoff_max_s=600.0,
        replace_max_per_hour=6,
        time_limit_s=600.0,
    )
    return msgspec.structs.replace(base, **over)


# Slurm's shortest limit (a minute) and a TERM lead that leaves a cell time to serve first.
CELL_LIMIT = "1"
SIGNAL_LEAD_S = 20


def service_sets(front_port: int, *extra: str) -> list[str]:
    """``--set`` flags of a small service: cells of 1 prefill + 1 decode, a one-minute limit
    with the TERM 20 s before it (the cluster file's), the successor submitted 50 s before
    the end (30 s before the TERM), a short drain, the front on ``front_port``."""
    sets = [
        *FAST,
        "roles.decode.nodes=1",
        "roles.decode.workers=1",
        f"slurm.time_limit='{CELL_LIMIT}'",
        f"service.front.port={front_port}",
        "service.successor_lead_s=50",
        "service.drain_s=15",
        "service.replace.backoff_s=1",
        *extra,
    ]
    return [arg for s in sets for arg in ("--set", s)]


def cluster_file(folder: Path) -> Path:
    """A cluster file for local cells: loopback, processes, the short TERM lead."""
    path = folder / "cluster.yaml"
    path.write_text(f"{CLUSTER_FILE}signal_lead_s: {SIGNAL_LEAD_S}\n")
    return path


class ServeProc:
    """``tilert-submit serve`` of one service directory; a context manager that kills the front
    and every process of every cell on exit."""

    def __init__(
        self,
        sdir: Path,
        args: Sequence[str],
        *,
        recipe: Path = DEMO_RECIPE,
        env: Mapping[str, str] | None = None,
        local: bool = True,
    ) -> None:
        self.sdir = sdir
        self.local = local
        self.recipe = recipe
        self.args = list(args)
        self.env = None if env is None else dict(env)
        self.fronts: list[subprocess.Popen[bytes]] = []
        self.outs: list[Path] = []
        self._outs: list[IO[bytes]] = []
        self.start()

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The front now (the last started)."""
        return self.fronts[-1]

    def start(self) -> None:
        """Start a front on the service directory (again, after ``kill``)."""
        out_path = self.sdir.parent / f"{self.sdir.name}.serve-{len(self.fronts) + 1}.out"
        self.outs.append(out_path)
        out = open(out_path, "wb")  # noqa: SIM115 (closed in __exit__)
        self._outs.append(out)
        argv = [*SUBMIT, "serve", str(self.recipe), *(["--local"] if self.local else []), "--mock"]
        self.fronts.append(
            subprocess.Popen(
                [*argv, "--service-dir", str(self.sdir), *self.args],
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def output(self, which: int = -1) -> str:
        """What front ``which`` (default: the last) printed."""
        return self.outs[which].read_text(errors="replace")

    def service(self) -> dict[str, Any]:
        """``service.json`` now ({} before the front wrote it)."""
        try:
            data: dict[str, Any] = json.loads((self.sdir / "service.json").read_text())
        except (OSError, ValueError):
            return {}
        return data

    def cells(self) -> dict[str, dict[str, Any]]:
        """The cells of ``service.json`` by name."""
        return {c["name"]: c for c in self.service().get("cells", [])}

    def wait(self, what: str, predicate: Any, timeout: float) -> dict[str, Any]:
        """``service.json`` once ``predicate(it)`` holds; fails if the front exited."""

        def check() -> dict[str, Any] | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"the front exited {self.proc.returncode}:\n{self.output()}")
            status = self.service()
            return status if status and predicate(status) else None

        found = wait_for(what, check, timeout, detail=lambda: json.dumps(self.service())[-3000:])
        assert found is not None
        return found

    def kill(self) -> None:
        """SIGKILL the front (its cells run on)."""
        self.proc.kill()
        self.proc.wait(10)

    def stop(self, timeout: float) -> int | None:
        """SIGTERM the front: it stops every cell, then exits; its code (None: still running)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def cell_processes(self) -> list[psutil.Process]:
        """Every live process of every cell (a scan of their job directories)."""
        cells = self.sdir / "cells"
        jobs = [p for p in cells.iterdir() if p.is_dir()] if cells.is_dir() else []
        return [proc for job in jobs for proc in job_processes(job, job_ports(job))]

    def __enter__(self) -> ServeProc:
        return self

    def __exit__(self, *exc: object) -> None:
        for front in self.fronts:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(front.pid, signal.SIGKILL)
        for cell in self.service().get("cells", []):
            if cell.get("local_pid"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(cell["local_pid"], signal.SIGKILL)
        kill_all(self.cell_processes())
        for front in self.fronts:
            with contextlib.suppress(subprocess.TimeoutExpired):
                front.wait(timeout=5)
        for out in self._outs:
            out.close()


def nothing_left(serve: ServeProc, timeout: float) -> list[psutil.Process]:
    """The cells' processes still alive after ``timeout``."""
    return still_alive(serve.cell_processes(), timeout)


# A cell's prefill made to crash-loop (agent/standins/faults.py): the prefill stand-in's first
# FAULT_STARTS starts counted in a file die CRASH_AFTER_S after starting. The file starts full
# (every start clean); ``crash_loop_prefill`` empties it and kills one cell's prefill engine, so
# that cell's restarts crash until its head gives up (agent.restart.max_restarts), while the
# other cells, which start nothing, serve on. The replacement's prefill starts clean again.
CRASH_STARTS = 3


def crash_env(starts_file: Path, base: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus the stand-in switches of a prefill crash-loop armed by ``starts_file``."""
    starts_file.write_bytes(b"." * CRASH_STARTS)
    return {
        **base,
        "TILERT_MOCK_FAULT_TARGET": "prefill-0",
        "TILERT_MOCK_CRASH_AFTER_S": "0.5",
        "TILERT_MOCK_FAULT_STARTS": str(CRASH_STARTS),
        "TILERT_MOCK_FAULT_STARTS_FILE": str(starts_file),
    }


def crash_loop_prefill(job: Path, starts_file: Path) -> None:
    """Make cell ``job``'s prefill crash-loop: the next CRASH_STARTS starts die; kill it now."""
    status = json.loads((job / "status.json").read_text())
    prefill = next(a for a in status["agents"] if a["name"] == "prefill-0")
    pid = int(httpx.get(prefill["status_url"], timeout=10).json()["pid"])
    starts_file.write_bytes(b"")
    os.kill(pid, signal.SIGKILL)
