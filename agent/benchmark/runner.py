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

from agent.benchmark.aiperf import EXPORT_FILE, RECORDS_FILE, aiperf_argv, level_requests
from agent.benchmark.plots import PlotsUnavailable, Series, make_plots
from agent.benchmark.results import ResultsError, read_level, read_records
from agent.benchmark.summary import write_summary
from agent.benchmark.target import BenchTarget, client_env
from agent.benchmark.verdict import exit_words, level_failure
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
from agent.problems import printable

CLIENT_NAME = "benchmark"
# What to do when AIPerf cannot run where the client runs.
AIPERF_HINT = (
    "set benchmark.aiperf_command (and benchmark.container_image under pyxis) to where AIPerf "
    "is installed"
)
PREFLIGHT_TIMEOUT_S = 120.0
_SAID_MAX = 300
# What the summary says of a custom command that exited 0 and left no AIPerf folder.
NO_RESULTS_NOTE = "no results to judge"


def _said(sink: LogSink) -> str | None:
    """What the client said last about an error (its last ERROR line, else its last line),
    escaped: it goes into status.json and onto terminals."""
    lines = [ln.strip(" │|\t") for ln in sink.recent(40) if ln.strip() and not ln.startswith("===")]
    for line in reversed(lines):
        if "ERROR" in line or "Error:" in line or "Reason:" in line:
            return printable(line[:_SAID_MAX])
    return printable(lines[-1][:_SAID_MAX]) if lines else None


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
        # Why the last client could not even start (names the key to fix).
        self._cannot_start: str | None = None

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
            return (
                f"cannot run the benchmark client {program!r}{where}: {exc.strerror or exc}; "
                f"{AIPERF_HINT}"
            )
        if code != 0:
            tail = printable(" | ".join(out.decode(errors="replace").strip().splitlines()[-3:]))
            return (
                f"the benchmark client `{program} --version`{where} {exit_words(code)}: "
                f"{tail or 'no output'}; {AIPERF_HINT}"
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
        note: str | None = None
        self._scope.deadline = trio.current_time() + self.plan.timeout_s
        try:
            with self._scope:
                try:
                    if error is None and self.plan.type == "aiperf":
                        error = await self._levels(sink, levels)
                    elif error is None:
                        error, exit_code, note = await self._custom(sink, levels)
                except Exception as exc:  # a defect here fails the benchmark, never the job
                    self.log.exception("benchmark: unexpected error")
                    error = printable(f"the benchmark stopped on an unexpected error: {exc!r}")
            if self._scope.cancelled_caught:
                at = f" during concurrency {self.block.level}" if self.block.level else ""
                done = f" ({self.block.levels_done} of {self.block.levels_total} levels done)"
                reason = self._interrupted or (
                    f"did not end within benchmark.timeout_s ({self.plan.timeout_s:g}s); "
                    "raise it for longer runs"
                )
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
            note=note,
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
            level = judge_level(
                folder,
                gpus=self.target.gpus,
                concurrency=concurrency,
                exit_code=code,
                requested=level_requests(self.plan, concurrency),
                max_error_rate=self.plan.max_error_rate,
                client_said=self._cannot_start or _said(sink),
            )
            levels.append(level)
            if not level.passed:
                return level.error
            self._update(levels_done=index + 1)
        return None

    async def _custom(
        self, sink: LogSink, levels: list[LevelResult]
    ) -> tuple[str | None, int | None, str | None]:
        """Run the custom command, then judge every AIPerf folder it left like a level of ours;
        (why it failed, its exit status, the summary's note)."""
        env = client_env(self.target, self.files.root, self.env)
        code = await self._client(sink, "custom", ["bash", "-c", self.plan.command or ""], env)
        folders = sorted(
            {
                p.parent
                for name in (EXPORT_FILE, RECORDS_FILE)
                for p in self.files.root.glob(f"*/{name}")
            }
        )
        judged = [
            judge_level(
                folder,
                gpus=self.target.gpus,
                concurrency=None,
                exit_code=None,
                requested=None,
                max_error_rate=self.plan.max_error_rate,
                client_said=None,
            )
            for folder in folders
        ]
        levels.extend(sorted(judged, key=lambda lv: lv.concurrency))
        if code:
            said = self._cannot_start or _said(sink)
            return (
                f"the custom command {exit_words(code)}" + (f": {said}" if said else ""),
                code,
                None,
            )
        failed = next((lv.error for lv in levels if not lv.passed), None)
        if failed is not None:
            return failed, code, None
        if not levels and self.plan.require_results:
            return (
                f"the custom command exited 0 and left no AIPerf results in {self.files.root} "
                "(benchmark.require_results is set): write them under $TILERT_BENCH_RESULTS_DIR/"
                "<name>/, or unset require_results",
                code,
                None,
            )
        return None, code, None if levels else NO_RESULTS_NOTE

    async def _client(self, sink: LogSink, what: str, argv: list[str], env: dict[str, str]) -> int:
        """Run the client once to its end; its exit status (cancellation stops it first)."""
        spec = self.launch_spec(CLIENT_NAME, argv, env, self.plan.image)
        self._cannot_start = None
        try:
            process = await self.launcher.start(spec)
        except OSError as exc:
            self._cannot_start = f"cannot start {argv[0]}: {exc.strerror or exc}" + (
                f"; {AIPERF_HINT}" if self.plan.type == "aiperf" else ""
            )
            sink.note(f"=== {what}: {self._cannot_start} ===")
            return 127
        sink.note(f"=== {what}: pid {process.pid}: {' '.join(argv)} ===")
        code: int | None = None
        try:
            code = await sink.pump_until_exit(process)
        finally:
            with trio.CancelScope(shield=True):
                stopped = await process.stop(self.plan.stop_grace_s)
            if code is None:  # cancelled: stop() ended it
                why = self._interrupted or "out of benchmark.timeout_s"
                sink.note(f"=== {what}: {why}: it {exit_words(stopped)} ===")
        sink.note(f"=== {what}: it {exit_words(code)} ===")
        return code


def judge_level(
    folder: Path,
    *,
    gpus: int,
    concurrency: int | None,
    exit_code: int | None,
    requested: int | None,
    max_error_rate: float,
    client_said: str | None,
) -> LevelResult:
    """One level judged by what its AIPerf folder measured, whoever ran the client (ours: its
    ``concurrency`` and ``exit_code``; a custom command's: both from the folder). Never raises:
    a folder that cannot be read fails its level, naming the file."""
    fields: dict[str, object] = {"concurrency": concurrency or 0, "results": str(folder)}
    results_error = request_error = None
    try:
        read = read_level(folder, gpus, concurrency)
        fields.update(read.fields)
        request_error = read.request_error
        requested = requested if requested is not None else read.requested
    except ResultsError as exc:
        results_error = str(exc)
        try:  # no summary (every request failed): the per-request records say why
            ok, failed, tokens, request_error = read_records(folder)
            fields.update(requests_ok=ok, requests_failed=failed, output_tokens=tokens)
        except ResultsError:
            pass
    level = msgspec.convert({**fields, "passed": True, "client_exit_code": exit_code}, LevelResult)
    ours = concurrency is not None
    why = level_failure(
        concurrency=level.concurrency,
        exit_code=exit_code,
        requests_ok=level.requests_ok,
        requests_failed=level.requests_failed,
        output_tokens=level.output_tokens,
        requested=requested,
        max_error_rate=max_error_rate,
        results_error=results_error,
        request_error=request_error,
        client_said=client_said,
        where=None if ours else _custom_where(level.concurrency, folder),
    )
    return msgspec.structs.replace(level, passed=why is None, error=why)


def _custom_where(concurrency: int, folder: Path) -> str:
    """How a reason names a custom command's level: its concurrency (when its export says) and
    its folder."""
    return f"concurrency {concurrency} in {folder}" if concurrency else f"the results in {folder}"
