"""``tilert-submit logs -f`` (and every read of node-local logs): all sources at once, under trio.

Each source's history is printed in turn, in name order; then every source is followed at once,
and sources that appear later (an agent that starts late, a pattern's new match) join at the next
rescan. The history of every source found at the start is printed whatever the end watcher has
decided meanwhile (an agent that failed before ``logs -f`` started is the one whose lines matter
most); only Ctrl-C cuts it short. It ends:

- when the job ends (``jobend``): the followers read what is left and the exit code is the job's
  (0 stopped, 1 failed), as ``kubectl logs -f`` ends with its container;
- on Ctrl-C or SIGTERM (exit 0);
- when the reader of a pipe goes away (``| head``): quietly, exit 0.

Sources on the job directory are read with ``LogFollower``; node-local ones through their agent
(``remote``). Without ``-f`` only node-local logs come here (their reads are streamed over HTTP).
"""

from __future__ import annotations

import os
import select
import signal
import stat
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import httpx
import msgspec
import trio

from agent.job.logtail import LogLine, history, open_log
from agent.job.paths import JobDir
from agent.job.plan import load_plan
from submit.logview import remote
from submit.logview.catalogue import Selection, Source, missing_log
from submit.logview.jobend import Ended, JobEnd
from submit.logview.options import Options
from submit.logview.printer import Printer, say

RESCAN_S = 1.0
POLL_S = 0.2
END_POLL_S = 0.5
# After the end: how long followers may take to print what is left (then they are cancelled).
LAST_READ_S = 5.0
# An agent that could not be reached is asked again this often while following.
RETRY_S = 2.0
# After the end, how long a stream its agent does not end itself may still bring lines.
REMOTE_LAST_S = 1.0
DEFAULT_DRAIN_S = 60.0


@dataclass
class _Answer:
    """How one request to an agent went."""

    streamed: bool = False  # lines came (the next request asks only for new ones)
    wrong: str | None = None  # the agent could not be reached, or the stream broke
    missing: str | None = None  # the agent has not started, or the log does not exist yet


class Session:
    """One run of ``tilert-submit logs`` that needs trio: the sources, the end, the exit code."""

    def __init__(
        self, job: JobDir, selection: Selection, options: Options, printer: Printer, token: str
    ) -> None:
        self.job = job
        self.selection = selection
        self.options = options
        self.printer = printer
        # Set at the end (or on a signal): followers read what is left and return.
        self.stop = trio.Event()
        # Set on a signal only: a history being printed is cut short too.
        self.cut = trio.Event()
        self.ended: Ended | None = None
        self.unreachable: list[str] = []
        self.client: httpx.AsyncClient | None = None
        # The job's bearer token, for the agents' /logs (node-local logs only).
        self.token = token
        named = None if selection.everything else selection.names()
        self.end = JobEnd(job, named)
        self.interrupted = False
        self._scope = trio.CancelScope()

    async def run(self) -> int:
        """Print (and follow); the exit code."""
        remote_view = self.selection.catalogue.node_local
        async with AsyncExitStack() as stack:
            if remote_view:
                self.client = await stack.enter_async_context(httpx.AsyncClient())
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                await nursery.start(self._on_signal)
                if self.options.follow:
                    nursery.start_soon(self._watch_end)
                    nursery.start_soon(self._watch_stdout)
                async with trio.open_nursery() as readers:
                    await self._read_all(readers)
                    # Ended or interrupted: followers print what is left, within a bound.
                    readers.cancel_scope.deadline = trio.current_time() + LAST_READ_S
                nursery.cancel_scope.cancel()
        if self.interrupted:
            return 130  # Ctrl-C while printing without -f: the shell's convention
        if self.ended is not None:
            if self.ended.code:
                say(self.ended.why)
            return self.ended.code
        return 1 if self.unreachable else 0

    async def _read_all(self, nursery: trio.Nursery) -> None:
        """Start a reader per source in turn (each after the previous one's history)."""
        started: set[str] = set()
        first = True
        # The first pass runs even when the end was decided already: its histories come first.
        while first or not self.stop.is_set():
            sources = await trio.to_thread.run_sync(self.selection.sources)
            if first and not sources:
                say(f"no logs yet in {self.job.logs} (no agent has started)")
            for source in sources:
                ended = self.cut.is_set() or (not first and self.stop.is_set())
                if source.name in started or ended:
                    continue
                started.add(source.name)
                reader = self._read_remote if source.remote else self._read_local
                await nursery.start(reader, source, not first or self.selection.everything)
            first = False
            if not self.options.follow:
                return
            with trio.move_on_after(RESCAN_S):
                await self.stop.wait()

    def _emit(self, name: str, lines: list[LogLine]) -> None:
        self.printer.emit(name, lines)

    async def _read_local(
        self,
        source: Source,
        quiet: bool,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        o = self.options
        if not quiet and not await trio.to_thread.run_sync(source.path.exists):
            say(missing_log(source, o.follow))
        follower = open_log(source.path, tail_lines=o.tail, since=o.since, timestamps=o.timestamps)
        try:
            past = history(follower, rotated=o.rotated)
            while (batch := await trio.to_thread.run_sync(next, past, None)) is not None:
                self._emit(source.name, batch)
                if self.cut.is_set():
                    break
            task_status.started()
            async for batch in follower.batches(poll_s=POLL_S, stop=self.stop):
                self._emit(source.name, batch)
        finally:
            follower.close()

    async def _read_remote(
        self,
        source: Source,
        quiet: bool,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """A node-local source through its agent: once without -f; with -f asked again whenever
        the stream ends or the agent cannot be reached, until the end."""
        agent = source.agent
        if agent is None:
            raise RuntimeError(f"{source.name} is not read through an agent")
        o = self.options
        tail = o.tail
        said: str | None = None
        live = trio.Event()

        def on_live() -> None:
            if not live.is_set():
                live.set()
                task_status.started()

        while True:
            answer = _Answer()
            async with trio.open_nursery() as guard:
                # At the end its agent sends the last lines and ends the stream; one whose agent
                # goes on (a NAME that failed) gets a moment for them, then it is cut.
                guard.start_soon(self._cut_after_stop, guard.cancel_scope, live)
                await self._ask(source, tail, answer, on_live)
                guard.cancel_scope.cancel()
            on_live()  # the next source's history need not wait for this agent
            if answer.streamed:
                tail = 0  # asked again later: only what is new (the rest was printed)
            if answer.missing is not None and not quiet and said is None:
                wait = "; waiting for it" if o.follow else ""
                say(f"{source.name}: no log yet ({answer.missing}){wait}")
                said = answer.missing
            if not o.follow:
                if answer.wrong is not None:
                    say(f"{source.name}: {answer.wrong}")
                    self.unreachable.append(source.name)
                return
            wrong = answer.wrong
            if wrong is None and answer.missing is None:
                wrong = "its agent ended the stream"
            with trio.move_on_after(RETRY_S):
                await self.stop.wait()
            if self.stop.is_set():
                return
            # An agent that stops ends its stream: nothing to say then.
            if (
                wrong is not None
                and wrong != said
                and not await trio.to_thread.run_sync(self.end.winding_down, agent)
            ):
                say(f"{source.name}: {wrong}; asking again every {RETRY_S:g}s")
                said = wrong

    async def _ask(
        self, source: Source, tail: int | None, answer: _Answer, on_live: Callable[[], None]
    ) -> None:
        """One request to the agent holding ``source``; how it went goes into ``answer``."""
        client = self.client
        if client is None or source.agent is None:
            raise RuntimeError("a node-local source needs the HTTP client")

        def on_lines(lines: list[LogLine]) -> None:
            answer.streamed = True
            self._emit(source.name, lines)

        try:
            base = await trio.to_thread.run_sync(remote.agent_url, self.job, source.agent)
            await remote.stream(
                client,
                base,
                self.token,
                source,
                self.options,
                tail=tail,
                on_lines=on_lines,
                on_live=on_live,
            )
        except remote.NoLogYet as exc:
            answer.missing = str(exc)
        except remote.Unreachable as exc:
            answer.wrong = str(exc)
            answer.streamed = answer.streamed or exc.streamed

    async def _cut_after_stop(self, scope: trio.CancelScope, live: trio.Event) -> None:
        """After the end: the history first (within LAST_READ_S), then a moment for the rest."""
        await self.stop.wait()
        if not self.cut.is_set():
            with trio.move_on_after(LAST_READ_S):
                await live.wait()
        await trio.sleep(REMOTE_LAST_S)
        scope.cancel()

    async def _watch_end(self) -> None:
        """Set ``stop`` once the job (or the named agents) ended, after its processes are gone."""
        end = self.end
        while not self.stop.is_set():
            ended = await trio.to_thread.run_sync(end.check)
            if ended is not None:
                if ended.job:
                    await self._wait_gone(end, ended)
                self.ended = ended
                self.stop.set()
                return
            with trio.move_on_after(END_POLL_S):
                await self.stop.wait()

    async def _wait_gone(self, end: JobEnd, ended: Ended) -> None:
        """Wait for the job's processes to end (their last lines), within the drain grace."""
        try:
            limit = load_plan(self.job.plan.read_bytes()).drain_s()
        except (OSError, ValueError, msgspec.DecodeError, msgspec.ValidationError):
            limit = DEFAULT_DRAIN_S
        said = False
        with trio.move_on_after(limit):
            while not self.stop.is_set():
                if await trio.to_thread.run_sync(end.gone_now):
                    return
                if not said:  # a wait of up to the drain grace: say what it waits for
                    said = True
                    say(
                        f"{ended.why.split(':')[0]}; printing its last lines until its "
                        f"processes end (at most {limit:g}s)"
                    )
                with trio.move_on_after(POLL_S):
                    await self.stop.wait()

    async def _watch_stdout(self) -> None:
        """End quietly when stdout is a pipe whose reader has gone (``| head``), even while no
        line comes to find it out."""
        try:
            fd = sys.stdout.fileno()
            kind = os.fstat(fd).st_mode
        except (OSError, ValueError, AttributeError):
            return
        if not (stat.S_ISFIFO(kind) or stat.S_ISSOCK(kind)):
            return
        poller = select.poll()
        poller.register(fd, select.POLLERR)
        while not self.stop.is_set():
            if poller.poll(0):
                raise BrokenPipeError("the reader of stdout has gone")
            with trio.move_on_after(POLL_S * 2.5):
                await self.stop.wait()

    async def _on_signal(
        self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for _ in signals:
                self.cut.set()
                self.stop.set()
                if not self.options.follow:
                    self.interrupted = True
                    self._scope.cancel()
                return
