"""Helpers for the tests of ``tilert-submit logs`` on real jobs (test_logs_cli, test_logs_slurm)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from tests import kit
from tests.kit import REPO, clean_env

# --timestamps' form: ISO 8601, UTC, milliseconds.
STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
# The engine log sources of a demo job, in the order logs shows them.
ENGINES = [*kit.AGENTS, "router"]


def logs(
    job: Path, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``tilert-submit logs J ARGS`` to its end."""
    return kit.submit_cmd("logs", str(job), *args, env=env or clean_env(), timeout=60)


def by_source(lines: list[str]) -> dict[str, list[str]]:
    """``{name: [text, ...]}`` of prefixed lines (fails on a line without a prefix)."""
    out: dict[str, list[str]] = {}
    for line in lines:
        name, sep, rest = line.partition(" | ")
        assert sep, f"line without a name prefix: {line!r}"
        out.setdefault(name.strip(), []).append(rest)
    return out


def file_lines(path: Path) -> list[str]:
    """A log file's lines as ``logs`` prints them (replacement characters for bad UTF-8)."""
    return path.read_bytes().decode("utf-8", "replace").splitlines()


class Follower:
    """``tilert-submit logs J -f ...`` in the background; its stdout collected line by line."""

    def __init__(self, job: Path, *args: str, env: Mapping[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*kit.SUBMIT, "logs", str(job), "-f", *args],
            cwd=REPO,
            env=dict(env or clean_env()),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        stdout = self.proc.stdout
        assert stdout is not None

        def read() -> None:
            with stdout:  # closed at EOF: the process ended
                for line in stdout:
                    self._queue.put(line)

        threading.Thread(target=read, daemon=True).start()

    def until(self, pred: Callable[[list[str]], bool], what: str, timeout: float = 20) -> None:
        """Read lines until ``pred(lines)``."""
        deadline = time.monotonic() + timeout
        while not pred(self.lines):
            assert time.monotonic() < deadline, f"not seen: {what}; last lines: {self.lines[-8:]}"
            try:
                self.lines.append(self._queue.get(timeout=0.2).rstrip("\n"))
            except queue.Empty:
                assert self.proc.poll() is None, f"ended with {self.proc.returncode}: {self.err()}"

    def wait(self, timeout: float) -> int:
        """Its exit code once it ended by itself (fails if it does not within ``timeout``)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"logs -f still running after {timeout:g}s") from None
        time.sleep(0.2)  # the reader thread takes the rest
        while not self._queue.empty():
            self.lines.append(self._queue.get().rstrip("\n"))
        return code

    def err(self) -> str:
        """Its stderr (once it has ended)."""
        stderr = self.proc.stderr
        assert stderr is not None
        if self.proc.poll() is None or stderr.closed:
            return ""
        with stderr:
            return stderr.read()

    def kill(self) -> None:
        """Kill it if it is still running."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
