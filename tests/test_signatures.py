"""Every failure signature, through a stand-in's fault switch, the supervisor's reason and diagnose.

Each ``TILERT_MOCK_FAILURE`` mode runs its real stand-in program (decode, prefill or router) under
a real ``EngineSupervisor``: a startup failure must leave the engine ``failed`` with the cause and
the fix in its reason (a fatal one at once, without a restart), a serving one ``healthy`` with
the cause in its reason; the log file it wrote must show the signature to ``diagnose``'s scan at
the right line. The catalogue alone: tests/test_signature_catalogue.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from agent.launch import LaunchSpec, ProcessLauncher
from agent.node.logpump import LogSink
from agent.node.supervisor import EngineSupervisor
from agent.signatures import BY_NAME, for_role
from agent.standins.failmodes import MODES, FailMode
from submit.diagnose import scan_file
from tests import kit
from tests.infra.ports import free_port
from tests.test_supervisor import policy

PY = sys.executable
# Processes at once: the machine has two cores, and a stand-in takes about a second to import.
PARALLEL = 6
WAIT_S = 60.0


def _argv(mode: FailMode) -> list[str]:
    if mode.program == "decode":
        return [PY, "-m", "agent.standins.decode", "--engine", "tilert"]
    if mode.program == "prefill":
        return [PY, "-m", "agent.standins.prefill", "serve", "demo", "--host", "127.0.0.1"]
    return [
        *[PY, "-m", "agent.standins.router", "--vllm-url", "http://127.0.0.1:9"],
        *["--decode", "127.0.0.1:9:9", "--host", "127.0.0.1"],
    ]


def _flags(mode: FailMode, port: int) -> list[str]:
    if mode.program == "decode":
        return ["--http-port", str(port), "--ctrl-port", str(free_port())]
    return ["--port", str(port)]


class Run:
    """One stand-in with one failure switch under a real supervisor."""

    def __init__(self, name: str, tmp: Path) -> None:
        self.name = name
        self.mode = MODES[name]
        self.port = free_port()
        self.log_file = tmp / name / "engine.log"
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "PYTHONPATH": str(kit.REPO),
            "PYTHONUNBUFFERED": "1",
            "TILERT_PD_PROBE_ADDR": "127.0.0.1",
            "TILERT_MOCK_FAILURE": name,
        }
        argv = [*_argv(self.mode), *_flags(self.mode, self.port)]
        self.sup = EngineSupervisor(
            name=f"{self.mode.program}-{name}",
            launcher=ProcessLauncher(),
            build=lambda: LaunchSpec(name=name, argv=argv, env=env),
            health_url=lambda: f"http://127.0.0.1:{self.port}/health",
            ports=lambda: {"http": self.port},
            policy=policy(restart_max=0, startup_budget_s=WAIT_S),
            sink=LogSink(self.log_file, max_bytes=1 << 20, backups=0),
            log=logging.getLogger(f"test-signatures-{name}"),
            on_change=lambda: None,
            where=self.mode.program,
        )

    def settled(self) -> bool:
        watch = self.sup.watch
        if self.mode.when == "start":
            return self.sup.state == "failed"
        return self.sup.state == "healthy" and watch is not None and bool(watch.findings)

    async def run(self, limiter: trio.CapacityLimiter) -> tuple[str, str]:
        """Supervise until settled; the state and the reason then."""
        async with limiter, trio.open_nursery() as nursery:
            nursery.start_soon(self.sup.run)
            with trio.fail_after(WAIT_S):
                while not self.settled():  # noqa: ASYNC110 - "healthy with a finding" has no event
                    await trio.sleep(0.05)
            status = self.sup.status()
            await self.sup.stop()
        return status.state, status.reason


async def test_every_failure_switch_is_named_in_reason_and_diagnose(tmp_path: Path) -> None:
    runs = [Run(name, tmp_path) for name in sorted(MODES)]
    reasons: dict[str, tuple[str, str]] = {}
    limiter = trio.CapacityLimiter(PARALLEL)

    async def one(run: Run) -> None:
        reasons[run.name] = await run.run(limiter)

    async with trio.open_nursery() as nursery:
        for run in runs:
            nursery.start_soon(one, run)
    for run in runs:
        sig = BY_NAME[run.name]
        state, reason = reasons[run.name]
        watch = run.sup.watch
        assert watch is not None
        best = watch.diagnosis()
        assert best is not None, (run.name, reason)
        assert best.signature.name == run.name, (run.name, reason)
        assert best.cause in reason, (run.name, reason)
        assert sig.fix in reason, (run.name, reason)
        if run.mode.when == "serve":
            assert state == "healthy", (run.name, reason)
            assert "but its log shows" in reason, reason
        else:
            assert state == "failed", (run.name, reason)
        if run.mode.when == "start" and sig.fatal:
            # A fatal line ends the startup wait at once: no restart, no waiting out the budget.
            assert "its log shows a fatal error" in reason, (run.name, reason)
            assert run.sup.restarts == 0, run.name
        # diagnose's scan of the file finds it, at the line that holds it.
        found = [(n, f) for n, f in scan_file(run.log_file, for_role(run.mode.program))]
        names = {f.signature.name for _, f in found}
        assert run.name in names, (run.name, names)
        lines = run.log_file.read_text().splitlines()
        for number, finding in found:
            assert lines[number - 1].rstrip("\r") == finding.line, (run.name, number)


@pytest.mark.parametrize("bad", ["no-such-failure", "KV-LAYOUT-MISMATCH"])
def test_unknown_failure_name_exits_2_naming_it(bad: str) -> None:
    env = kit.clean_env(TILERT_MOCK_FAILURE=bad, TILERT_PD_PROBE_ADDR="127.0.0.1")
    done = subprocess.run(
        [PY, "-m", "agent.standins.decode"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert f"TILERT_MOCK_FAILURE={bad!r} names no known failure" in done.stderr
