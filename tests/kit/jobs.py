"""Jobs made and run as users make and run them, with ``tilert-submit``.

``make_job`` writes a job directory without starting anything (``--mock --dry-run``), for tests
that start agents themselves; ``LocalJob`` runs one (``--local --mock``) in a process group of its
own and kills whatever is left of it on exit. ``isolated_sets`` gives a job ports of its own, so
jobs of parallel tests (and other users of this machine) do not meet.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import psutil

from tests.infra.ports import free_port
from tests.kit.commands import DEMO_RECIPE, REPO, SUBMIT, clean_env
from tests.kit.jobdir import agent_entry, current_status, job_ports, log_tails, wait_status
from tests.kit.processes import job_processes, kill_all, still_alive
from tests.kit.waiting import wait_for

CLUSTER_FILE = "network_interface: lo\nlauncher: process\n"
# The job port bases isolated_sets hands out (20000-29900, above tests.infra.ports' range), in a
# random order drawn once: two jobs of this test run never get the same base until a hundred
# more came after (drawn each time, two jobs alive at once got the same one one time in a
# hundred: their agents then probe the same ports, and two starting at once can take the same).
_BASES = itertools.cycle(random.sample(range(20000, 30000, 100), 100))
# The demo's generous settings, made small so failures show within a second or two.
FAST = (
    "agent.restart.backoff_initial_s=0.05",
    "agent.restart.backoff_max_s=0.2",
    "agent.probe.interval_s=0.1",
    "agent.probe.timeout_s=0.5",
    "agent.stop_grace_s.decode=2",
    "agent.stop_grace_s.prefill=2",
)


def make_job(root: Path, *sets: str, recipe: Path = DEMO_RECIPE, fast: bool = True) -> Path:
    """``tilert-submit RECIPE --mock --dry-run --job-dir root/job --set ...`` with a cluster
    file saying ``network_interface: lo`` and ``launcher: process`` (everything on 127.0.0.1);
    the job directory. ``fast`` adds the ``FAST`` settings first."""
    root.mkdir(parents=True, exist_ok=True)
    cluster = root / "srtslurm.yaml"
    cluster.write_text(CLUSTER_FILE)
    job = root / "job"
    argv = [str(recipe), "--mock", "--dry-run", "--cluster", str(cluster), "--job-dir", str(job)]
    for item in (*(FAST if fast else ()), *sets):
        argv += ["--set", item]
    done = subprocess.run(
        [*SUBMIT, *argv], cwd=REPO, capture_output=True, text=True, env=clean_env(), timeout=60
    )
    if done.returncode != 0:
        raise RuntimeError(f"tilert-submit failed ({done.returncode}):\n{done.stderr}")
    return job


def isolated_sets(router_python: Path | None, *extra: str) -> tuple[list[str], int]:
    """``--set`` flags for a job of its own: a free router port (8000 is shared), port bases of
    its own, the real router when ``router_python`` is given, then ``extra``; and the router
    port."""
    port = free_port()
    # Port bases of our own, away from the defaults every other job on this shared machine
    # uses: a probed-free port is only free until someone binds it.
    b = next(_BASES)
    bases = (
        f"{{prefill: {{http: {b}, agent: {b + 10}}}, "
        f"decode: {{http: {b + 20}, agent: {b + 40}, ctrl: {b + 60}}}}}"
    )
    sets = [
        *([f"agent.router_python={router_python}"] if router_python else []),
        f"agent.router_port={port}",
        f"agent.ports={bases}",
        f"agent.front.port={b + 80}",
        *extra,
    ]
    return [arg for s in sets for arg in ("--set", s)], port


class LocalJob:
    """``tilert-submit RECIPE --local --mock`` in its own process group; a context manager that
    kills whatever is left (the group, every process of the job, every one it saw) on exit."""

    def __init__(
        self,
        job: Path,
        args: Sequence[str],
        *,
        recipe: Path = DEMO_RECIPE,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.job = job
        self.out = job.parent / f"{job.name}.submit.out"
        self._out: IO[bytes] = open(self.out, "wb")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen(
            [*SUBMIT, str(recipe), "--local", "--mock", "--job-dir", str(job), *args],
            cwd=REPO,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.seen: dict[int, psutil.Process] = {}

    def output(self) -> str:
        """What tilert-submit printed so far."""
        return self.out.read_text(errors="replace")

    def ended(self) -> bool:
        """tilert-submit has exited (the job is over)."""
        return self.proc.poll() is not None

    def status(self) -> dict[str, Any]:
        """status.json now (fails when it cannot be read)."""
        return current_status(self.job)

    def agent(self, name: str) -> dict[str, Any]:
        """status.json's entry of agent ``name`` now."""
        return agent_entry(self.status(), name)

    def token(self) -> str:
        """The job's bearer token."""
        return (self.job / "token").read_text().strip()

    def remember_tree(self) -> None:
        """Note every process below tilert-submit, to prove later that none outlives it."""
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.proc.pid)
            for proc in [root, *root.children(recursive=True)]:
                self.seen.setdefault(proc.pid, proc)

    def _watch(self) -> None:
        self.remember_tree()
        if self.proc.poll() is not None:
            raise AssertionError(
                f"tilert-submit exited {self.proc.returncode}:\n{self.output()}\n"
                f"{log_tails(self.job)}"
            )

    def wait_state(self, *states: str, timeout: float) -> dict[str, Any]:
        """status.json once its state is one of ``states``, noting the process tree on every
        poll; fails as soon as tilert-submit has exited."""
        return wait_status(
            self.job,
            lambda s: s["state"] in states,
            f"in {states}",
            timeout,
            poll_s=0.1,
            each=self._watch,
        )

    def wait_output(self, text: str, timeout: float) -> str:
        """Wait until tilert-submit has printed ``text``; its output."""

        def printed() -> str | None:
            out = self.output()
            if text in out:
                return out
            if self.proc.poll() is not None:
                raise AssertionError(f"tilert-submit exited without printing {text!r}:\n{out}")
            return None

        out = wait_for(f"tilert-submit to print {text!r}", printed, timeout, detail=self.output)
        assert out is not None  # wait_for returns only a value that passed
        return out

    def wait_exit(self, timeout: float) -> int:
        """Wait for tilert-submit to exit; its code (fails with its output when it does not)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"tilert-submit still running after {timeout:g}s:\n{self.output()}\n"
                f"{log_tails(self.job)}"
            ) from None

    def stop(self, timeout: float) -> tuple[int | None, list[psutil.Process]]:
        """SIGTERM tilert-submit; (its exit code or None after ``timeout``, the processes it was
        ever seen with that are still alive the moment it ended)."""
        self.remember_tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        return code, still_alive(list(self.seen.values()), 0)

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        leftovers = [*job_processes(self.job, job_ports(self.job)), *self.seen.values()]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        kill_all(leftovers)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._out.close()
