"""``BenchmarkRun``: the benchmark client against a ready job, one level after the other.

Each AIPerf level is a supervised one-shot process started through the caller's launcher (the
head's: pyxis runs it in the benchmark image), its output appended to one log, its results in a
folder of its own; the first level that fails ends the run (``agent.benchmark.verdict``). A
custom command is one process with the job's facts in its environment. At the end, whatever
happened (a failed level, a stop, the job failing under it), ``summary.json``, the table and the
plots are written and the status block says passed or failed, with the level and the reason.

``stop(reason)`` ends a run at once: the client gets SIGTERM and its grace, then SIGKILL; the
verdict is failed, naming the reason and the level it interrupted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import trio

from agent.benchmark.aiperf import EXPORT_FILE, aiperf_argv, level_requests
from agent.benchmark.plots import PlotsUnavailable, Series, make_plots
from agent.benchmark.results import ResultsError, read_level, read_records
from agent.benchmark.summary import write_summary
from agent.benchmark.target import BenchTarget, client_env
from agent.benchmark.verdict import level_failure
from agent.job.benchmark import (
    BenchmarkFiles,
    BenchmarkPlan,
    BenchmarkStatus,
    BenchmarkSummary,
    LevelResult,
    pending_block,
)
from agent.launch import Launcher, RunTimeout
from agent.launch.jobspecs import SpecBuilder
from agent.node.logpump import LogSink

CLIENT_NAME = "benchmark"
PREFLIGHT_TIMEOUT_S = 120.0
# How long the log pump may take to reach EOF after the client exited.
_SAID_MAX = 300


def _said(sink: LogSink) -> str | None:
    """What the client said last about an error (its last ERROR line, else its last line)."""
    lines = [ln.strip(" │|\t") for ln in sink.recent(40) if ln.strip() and not ln.startswith("===")]
    for line in reversed(lines):
        if "ERROR" in line or "Error:" in line or "Reason:" in line:
            return line[:_SAID_MAX]
    return lines[-1][:_SAID_MAX] if lines else None


class BenchmarkRun:
    """One run of a job's benchmark (the head's, or ``tilert-submit bench``'s)."""

    def __init__(
        self,
        plan: BenchmarkPlan,
        target: BenchTarget,
        files: BenchmarkFiles,
        *,
        launcher: Launcher,
        launch_spec: SpecBuilder,
        env: dict[str, str],
        log_path: Path,
        log_max_bytes: int,
        log_backups: int,
        log: logging.Logger,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.plan = plan
        self.target = target
        self.files = files
        self.launcher = launcher
        self.launch_spec = launch_spec
        self.env = env
        self.log_path = log_path
        self.log_max_bytes = log_max_bytes
        self.log_backups = log_backups
        self.log = log
        self.on_change = on_change
        self.block = pending_block(plan)
        self.summary: BenchmarkSummary | None = None
        self.done = trio.Event()
        self._scope = trio.CancelScope()
        self._interrupted: str | None = None

    # ---- what others read --------------------------------------------------------------------

    def status(self) -> BenchmarkStatus:
        """The ``benchmark`` block of status.json."""
        return self.block

    def _update(self, **changes: object) -> None:
        self.block = msgspec.structs.replace(self.block, **changes)
        self.on_change()

    @property
    def interrupted(self) -> bool:
        """Whether ``stop`` ended the run before it was done."""
        return self._interrupted is not None

    # ---- running -----------------------------------------------------------------------------

    async def preflight(self) -> str | None:
        """Why the client cannot run here (AIPerf: ``aiperf --version`` through the launcher)."""
        if self.plan.type != "aiperf":
            return None
        program = " ".join(self.plan.program)
        argv = [*self.plan.program, "--version"]
        spec = self.launch_spec(f"{CLIENT_NAME}-preflight", argv, dict(self.env), self.plan.image)
        where = f" in image {self.plan.image}" if self.plan.image else ""
        try:
            code, out = await self.launcher.run(spec, timeout_s=PREFLIGHT_TIMEOUT_S)
        except RunTimeout:
            return f"`{program} --version`{where} did not answer within {PREFLIGHT_TIMEOUT_S:g}s"
        except OSError as exc:
            return f"cannot run the benchmark client {program!r}{where}: {exc.strerror or exc}"
        if code != 0:
            tail = out.decode(errors="replace").strip().splitlines()[-3:]
            return (
                f"the benchmark client `{program} --version`{where} exited with status {code}: "
                f"{' | '.join(tail) or 'no output'}; set benchmark.aiperf_command (and "
                "benchmark.container_image under pyxis) to where AIPerf is installed"
            )
        return None

    def stop(self, reason: str) -> None:
        """End the run now: its client is stopped and the verdict is failed with ``reason``."""
        if not self.done.is_set():
            self._interrupted = reason
            self._scope.cancel()

    async def run(self) -> BenchmarkSummary:
        """Every level (or the custom command), then the summary; never raises for a failure."""
        started = time.time()
        self._update(state="running", started_at=started)
        levels: list[LevelResult] = []
        error: str | None = None
        exit_code: int | None = None
        try:
            self.files.root.mkdir(parents=True, exist_ok=True)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a full or read-only job directory: a failed run, not a crash
            error = f"cannot make {self.files.root}: {exc.strerror or exc}"
        sink = LogSink(self.log_path, max_bytes=self.log_max_bytes, backups=self.log_backups)
        try:
            with self._scope:
                if error is None and self.plan.type == "aiperf":
                    error = await self._levels(sink, levels)
                elif error is None:
                    error, exit_code = await self._custom(sink, levels)
            if self._scope.cancelled_caught:
                at = f" during concurrency {self.block.level}" if self.block.level else ""
                done = f" ({self.block.levels_done} of {self.block.levels_total} levels done)"
                reason = self._interrupted or "stopped"
                error = f"{reason}{at}" + (done if self.block.levels_total else "")
        finally:
            sink.close()
        summary = BenchmarkSummary(
            state="failed" if error else "passed",
            error=error,
            type=self.plan.type,
            model=self.target.model,
            router_url=self.target.router_url,
            isl=self.plan.isl,
            osl=self.plan.osl,
            num_requests=self.plan.num_requests,
            duration_s=self.plan.duration_s,
            req_rate=self.plan.req_rate,
            max_error_rate=self.plan.max_error_rate,
            gpus=self.target.gpus,
            client_exit_code=exit_code,
            started_at=started,
            ended_at=time.time(),
            levels=levels,
        )
        with trio.CancelScope(shield=True):
            summary, written = await trio.to_thread.run_sync(self._finish, summary)
        self.summary = summary
        self.log.info(
            "benchmark %s%s; summary %s",
            summary.state,
            f": {error}" if error else "",
            self.files.summary if written is True else f"not written ({written})",
        )
        self._update(
            state=summary.state,
            error=error,
            ended_at=summary.ended_at,
            summary=str(self.files.summary) if written is True else None,
        )
        self.done.set()
        return summary

    def _finish(self, summary: BenchmarkSummary) -> tuple[BenchmarkSummary, bool | str]:
        """Plots (when matplotlib is here), then summary.json and the table (in a thread);
        the summary, and True once written (else why not: the verdict stands all the same)."""
        try:
            title = f"{self.target.model} ({self.files.root.parent.name})"
            written = make_plots([Series("this job", summary.levels)], self.files.root, title)
            summary = msgspec.structs.replace(summary, plots=[p.name for p in written])
        except PlotsUnavailable as exc:
            summary = msgspec.structs.replace(summary, plots_note=str(exc))
        except Exception as exc:  # a chart must never cost the verdict
            summary = msgspec.structs.replace(summary, plots_note=f"plotting failed: {exc!r}")
        try:
            write_summary(self.files, summary)
        except OSError as exc:
            return summary, f"{self.files.summary}: {exc.strerror or exc}"
        return summary, True

    async def _levels(self, sink: LogSink, levels: list[LevelResult]) -> str | None:
        for index, concurrency in enumerate(self.plan.concurrencies):
            self._update(level=concurrency)
            folder = self.files.level_dir(concurrency)
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                return f"concurrency {concurrency}: cannot make {folder}: {exc.strerror or exc}"
            argv = aiperf_argv(self.plan, self.target, concurrency, folder)
            self.log.info(
                "benchmark: concurrency %d (level %d of %d), results %s",
                concurrency,
                index + 1,
                len(self.plan.concurrencies),
                folder,
            )
            code = await self._client(sink, f"concurrency {concurrency}", argv, dict(self.env))
            level = self._judge(sink, folder, concurrency, code)
            levels.append(level)
            if not level.passed:
                return level.error
            self._update(levels_done=index + 1)
        return None

    def _judge(self, sink: LogSink, folder: Path, concurrency: int, code: int) -> LevelResult:
        fields: dict[str, object] = {"concurrency": concurrency, "results": str(folder)}
        results_error = request_error = None
        try:
            measured, request_error = read_level(folder, self.target.gpus, concurrency)
            fields.update(measured)
        except ResultsError as exc:
            results_error = str(exc)
            try:  # no summary (every request failed): the per-request records say why
                ok, failed, tokens, request_error = read_records(folder)
                fields.update(requests_ok=ok, requests_failed=failed, output_tokens=tokens)
            except ResultsError:
                pass
        level = msgspec.convert({**fields, "passed": True, "client_exit_code": code}, LevelResult)
        why = level_failure(
            concurrency=concurrency,
            exit_code=code,
            requests_ok=level.requests_ok,
            requests_failed=level.requests_failed,
            output_tokens=level.output_tokens,
            requested=level_requests(self.plan, concurrency),
            max_error_rate=self.plan.max_error_rate,
            results_error=results_error,
            request_error=request_error,
            client_said=_said(sink),
        )
        return msgspec.structs.replace(level, passed=why is None, error=why)

    async def _custom(
        self, sink: LogSink, levels: list[LevelResult]
    ) -> tuple[str | None, int | None]:
        env = client_env(self.target, self.files.root, self.env)
        code = await self._client(sink, "custom", ["bash", "-c", self.plan.command or ""], env)
        # A custom command that runs AIPerf leaves its folders: their levels are shown too.
        for export in sorted(self.files.root.glob(f"*/{EXPORT_FILE}")):
            try:
                measured, _ = read_level(export.parent, self.target.gpus)
            except ResultsError:
                continue
            levels.append(msgspec.convert({**measured, "passed": True}, LevelResult))
        levels.sort(key=lambda lv: lv.concurrency)
        if code:
            said = _said(sink)
            return f"the custom command exited with status {code}" + (
                f": {said}" if said else ""
            ), code
        return None, code

    async def _client(self, sink: LogSink, what: str, argv: list[str], env: dict[str, str]) -> int:
        """Run the client once to its end; its exit status (cancellation stops it first)."""
        spec = self.launch_spec(CLIENT_NAME, argv, env, self.plan.image)
        try:
            process = await self.launcher.start(spec)
        except OSError as exc:
            sink.note(f"=== {what}: cannot start {argv[0]}: {exc} ===")
            return 127
        sink.note(f"=== {what}: pid {process.pid}: {' '.join(argv)} ===")
        code: int | None = None
        try:
            code = await sink.pump_until_exit(process)
        finally:
            with trio.CancelScope(shield=True):
                stopped = await process.stop(self.plan.stop_grace_s)
            if code is None:  # cancelled: stop() ended it
                sink.note(
                    f"=== {what}: {self._interrupted or 'stopped'}: exit status {stopped} ==="
                )
        sink.note(f"=== {what}: exited with status {code} ===")
        return code
