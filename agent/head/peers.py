"""What the head knows of every agent: its record (where it is) and its live ``/status`` (how it
is).

Records come from the rendezvous folder; states travel over each peer's long-polled ``/status``,
not through the shared file system (which caches attributes for seconds). Every answer that
changes what the head shows wakes it at once; a long poll that timed out on an unchanged peer
does not. The head's own state is read from its own agent, never over HTTP.

A peer is failed without its own word when its record stays unreadable past the retry (it never
had a good one), when its record carries its last word (``exited``), or when it has not answered
for ``UNREACHABLE_FAIL_S`` (killed, frozen, its node gone) while it had not said it was stopping.
A lost peer is still asked (every ``IDLE_POLL_S``), and a new record after a last word is a new
agent under the same name: either may report healthy again, and the head may take it back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import msgspec
import trio

from agent.http.longpoll import BarePoll, Fetch, PollFailed
from agent.job.logfiles import log_path
from agent.job.names import HEAD_NAME, parse_agent_name
from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.records import AgentStatus, JobAgent, RendezvousRecord
from agent.job.vocab import AgentState, Role
from agent.node.rendezvous import RecordReader, Records, watch_records
from agent.problems import printable

# A long poll asks the peer to answer within LONG_POLL_S even when nothing changed; one that has
# not answered ANSWER_MARGIN_S later is not answering (stopped, hung, gone).
LONG_POLL_S = 5.0
ANSWER_MARGIN_S = 2.0
RETRY_S = 0.2  # after a failed poll: the peer may be restarting its agent
# Unreachable is not dead at once (a network blip, a slow node): a peer that has not answered
# for this long, and whose record does not say it stopped, has failed (docs/reliability.md).
UNREACHABLE_FAIL_S = 5.0
# Failed polls in a row before a peer shows as unreachable: one alone can be the head's own pause
# (a long poll cut short when the head was frozen or starved), and is asked again at once.
UNREACHABLE_AFTER_POLLS = 2
IDLE_POLL_S = 1.0  # a peer that exited or was lost: look again only for a new record


def _steady(status: AgentStatus | None) -> AgentStatus | None:
    """An answer without what moves by itself (the engine's and the head's router's uptime): two
    answers of a peer where nothing happened compare equal."""
    if status is None:
        return None
    router = status.router
    if router is not None:
        router = msgspec.structs.replace(router, uptime_s=None)
    return msgspec.structs.replace(status, uptime_s=None, router=router)


@dataclass
class Peer:
    """One agent as the head sees it."""

    record: RendezvousRecord | None = None
    status: AgentStatus | None = None
    reachable: bool = False
    healthy_seen_at: float | None = None  # trio time the head saw it healthy
    # Why its record cannot be read (lasting past the retry); it keeps its last good one if any.
    record_problem: str | None = None
    # When (trio's clock) the current outage's first poll failed, its error, the failed polls.
    unreachable_since: float | None = None
    unreachable_error: str = ""
    failed_polls: int = 0
    # Why the head took it as failed without its word (not answering past the bound); for good.
    lost: str | None = None

    @property
    def state(self) -> AgentState:
        """Its state for the job: its own, or ``missing``, ``starting``, ``unreachable``,
        ``stopped``, ``failed`` (a record that stays unreadable, its last word, or lost)."""
        if self.record is None:
            return "failed" if self.record_problem else "missing"
        if self.record.exited is not None:
            return self.record.exited.state
        if self.lost is not None:
            return "failed"
        if self.status is None:
            return "unreachable" if self.failed_polls >= UNREACHABLE_AFTER_POLLS else "starting"
        if not self.reachable:
            # An agent that said it was stopping and is gone has stopped: not a lost peer.
            if self.status.state in ("stopping", "stopped"):
                return "stopped"
            return "unreachable"
        return self.status.state

    @property
    def reason(self) -> str:
        """Why it is in its state, in one line."""
        if self.record is None:
            return self.record_problem or "no rendezvous record yet"
        if self.record.exited is not None:
            exited = self.record.exited
            return printable(f"its agent exited with code {exited.code}: {exited.reason}")
        if self.lost is not None:
            return self.lost
        if self.status is None:
            reason = "record published; waiting for its first /status answer"
        else:
            reason = printable(self.status.reason)
        if self.failed_polls >= UNREACHABLE_AFTER_POLLS:
            reason = (
                f"not answering at {self.record.status_url} ({self.unreachable_error}); {reason}"
            )
        if self.record_problem:
            reason += f"; {self.record_problem} (its last good record is used)"
        return reason

    def observe(self, status: AgentStatus, now: float) -> bool:
        """Take a ``/status`` answer; note when it turned healthy. True when it changed what the
        head shows (a long poll that timed out on a peer where nothing changed returns False)."""
        was = (_steady(self.status), self.reachable, self.lost, self.failed_polls)
        back = self.lost is not None or self.status is None or self.status.state != "healthy"
        if status.state == "healthy" and back:
            self.healthy_seen_at = now
        self.status = status
        self.reachable = True
        self.unreachable_since = None
        self.failed_polls = 0
        # A peer taken as failed that answers again is what it says it is: the head decides
        # whether a dropped decode healthy again comes back (decisions.to_rejoin).
        self.lost = None
        return was != (_steady(status), True, None, 0)

    def reborn(self, record: RendezvousRecord) -> bool:
        """A new record after its last word, or after it was lost: a new agent under the same
        name (restarted by systemd, Slurm or by hand). True when the peer starts afresh."""
        old = self.record
        if old is None or old.updated_at == record.updated_at or record.exited is not None:
            return False
        if old.exited is None and self.lost is None:
            return False
        self.status, self.reachable, self.lost = None, False, None
        self.unreachable_since, self.failed_polls = None, 0
        return True

    def unanswered(self, error: str, now: float) -> bool:
        """A poll failed with ``error``; True when this changes what the head shows."""
        self.unreachable_error = error
        self.failed_polls += 1
        if self.unreachable_since is None:
            self.unreachable_since = now
        if self.failed_polls == UNREACHABLE_AFTER_POLLS:
            self.reachable = False
            return True
        stopping = self.status is not None and self.status.state in ("stopping", "stopped")
        if (
            self.lost is None
            and not stopping
            and self.failed_polls > UNREACHABLE_AFTER_POLLS
            and now - self.unreachable_since >= UNREACHABLE_FAIL_S
        ):
            last = f"; it last said {self.status.state}" if self.status else ""
            self.lost = (
                f"agent not answering for {UNREACHABLE_FAIL_S:g}s at "
                f"{self.record.status_url if self.record else '?'} ({error}){last}: taken as failed"
            )
            return True
        return False


class Peers:
    """Every agent of the job (the head first), followed over the records and ``/status``."""

    def __init__(
        self,
        names: list[str],
        *,
        job: JobDir,
        plan: Plan | None = None,
        own_status: Callable[[], AgentStatus],
        log: logging.Logger,
        on_change: Callable[[], None],
        fetch: Callable[[], Fetch] = BarePoll,
    ) -> None:
        self.by_name: dict[str, Peer] = {name: Peer() for name in names}
        # Makes each peer's long-poll fetcher: a bare connection per peer (agent.http.longpoll);
        # tests pass one over a mock httpx client.
        self.fetch = fetch
        self.job = job
        # Engine logs may live on each node's disk (agent.logs.location: node): the plan says.
        self.plan = plan
        self.own_status = own_status
        self.log = log
        self.on_change = on_change
        self._followed: set[str] = set()
        self._logs: dict[str, str] = {}
        self._parsed: dict[str, tuple[Role, int]] = {}
        self._strays: set[str] = set()
        # Reads the rendezvous folder; told about each decode that joins the pool (``add``).
        self._reader = RecordReader(job, names)

    # ---- what the head reads ---------------------------------------------------------------

    def state(self, name: str) -> AgentState:
        """The state of agent ``name``; the head's own is read live from its agent."""
        if name == HEAD_NAME:
            return self.own_status().state
        return self.by_name[name].state

    def refresh_own(self) -> bool:
        """Take the head's own status into its peer (for the gate's healthy times); True when it
        changed."""
        me = self.by_name[HEAD_NAME]
        return me.observe(self.own_status(), trio.current_time())

    def records(self) -> dict[str, RendezvousRecord]:
        """The records published so far, in listing order."""
        return {n: p.record for n, p in self.by_name.items() if p.record is not None}

    def record(self, name: str) -> RendezvousRecord:
        """The record of ``name``, which must have published one."""
        record = self.by_name[name].record
        if record is None:
            raise LookupError(f"{name} has published no rendezvous record")
        return record

    def healthy_since(self) -> dict[str, float | None]:
        """When the head saw each agent turn healthy (trio's clock)."""
        return {n: p.healthy_seen_at for n, p in self.by_name.items()}

    def healthy_at(self, name: str) -> float | None:
        """When ``name`` turned healthy on its own clock, as its /status says (the head's own
        status read live)."""
        status = self.own_status() if name == HEAD_NAME else self.by_name[name].status
        return status.healthy_at if status is not None else None

    def versions(self) -> dict[str, str]:
        """The tilert version each record names (agents whose preflight found one)."""
        found = {n: r.versions.get("tilert") for n, r in self.records().items()}
        return {n: v for n, v in found.items() if v}

    def entry(self, name: str, dropped: str | None = None) -> JobAgent:
        """The status.json row of ``name``; ``dropped`` is why the router no longer uses it."""
        peer = self.by_name[name]
        status = self.own_status() if name == HEAD_NAME else peer.status
        parsed = self._parsed.get(name) or parse_agent_name(name)
        if parsed is None:
            raise ValueError(f"not an agent name: {name!r}")
        self._parsed[name] = parsed
        # The head knows itself first hand: its record's fate does not change its state.
        reason = status.reason if status and name == HEAD_NAME else peer.reason
        if dropped is not None:
            reason = f"dropped from the router: {dropped}"
        return JobAgent(
            name=name,
            role=parsed[0],
            index=parsed[1],
            node=peer.record.node if peer.record else None,
            state=self.state(name),
            restarts=status.restarts if status else 0,
            reason=reason,
            log=self._log(name),
            metrics_url=peer.record.metrics_url if peer.record else None,
            status_url=peer.record.status_url if peer.record else None,
            convert=status.convert if status and status.convert else msgspec.UNSET,
            progress=status.progress if status and status.progress else msgspec.UNSET,
            progress_at=status.progress_at if status and status.progress_at else msgspec.UNSET,
        )

    def _log(self, name: str) -> str:
        """Where ``name``'s engine log is (fixed for the job; found once: a view of 1,024 agents
        is built on every wake of the head)."""
        found = self._logs.get(name)
        if found is None:
            found = self._logs[name] = str(log_path(self.job, name, plan=self.plan))
        return found

    def add(self, name: str) -> None:
        """Follow one more agent (a decode joining the pool); a known one is left as it is."""
        if name not in self.by_name:
            self.by_name[name] = Peer()
            self._reader.expect([name])

    # ---- following -------------------------------------------------------------------------

    async def follow(self, on_records: Callable[[], None]) -> None:
        """Watch the records and long-poll every peer that has one (runs forever).

        ``on_records`` is called after each change of the rendezvous folder.
        """
        async with trio.open_nursery() as nursery:

            def changed(records: Records) -> None:
                self._take(records, nursery)
                on_records()

            nursery.start_soon(
                partial(watch_records, reader=self._reader), self.job, list(self.by_name), changed
            )

    def _take(self, records: Records, nursery: trio.Nursery) -> None:
        for stray in records.strays:
            if stray not in self._strays:
                self._strays.add(stray)
                self.log.warning(
                    "head: ignoring %s in %s: not the record of an agent of this job (%s)",
                    stray,
                    self.job.rendezvous,
                    ", ".join(self.by_name),
                )
        for name, peer in self.by_name.items():
            problem = records.problems.get(name)
            if problem != peer.record_problem:
                if problem is not None:
                    self.log.warning("head: %s: %s", name, problem)
                else:
                    self.log.info("head: %s's rendezvous record is readable again", name)
                peer.record_problem = problem
        for name, record in records.by_name.items():
            peer = self.by_name[name]
            changed_ports = peer.record is not None and peer.record.ports != record.ports
            if record.exited is not None and (peer.record is None or peer.record.exited is None):
                self.log.warning("head: %s exited: %s", name, Peer(record=record).reason)
            if peer.reborn(record):
                self.log.info("head: %s published a new record: a new agent under its name", name)
            peer.record = record
            if changed_ports:
                self.log.info("head: %s republished its ports: %s", name, record.ports)
            if name != HEAD_NAME and name not in self._followed:
                self._followed.add(name)
                nursery.start_soon(self._poll, name)

    async def _poll(self, name: str) -> None:
        """Long-poll a peer's /status forever; each answer is pushed into the gate at once."""
        fetch = self.fetch()
        try:
            await self._poll_with(name, fetch)
        finally:
            fetch.close()

    async def _poll_with(self, name: str, fetch: Fetch) -> None:
        peer = self.by_name[name]
        version = -1
        polled: RendezvousRecord | None = None
        while True:
            # Read each time: every republish replaces the record.
            record = self.record(name)
            if record.exited is not None:
                await trio.sleep(IDLE_POLL_S)  # its word is said; a new record may follow
                continue
            if record != polled:
                # A new record may be a new agent, whose versions start again.
                polled, version = record, -1
            url = record.status_url
            # A fresh poll (version -1) is answered at once by a live agent.
            wait_s = LONG_POLL_S if version >= 0 else 0.0
            try:
                body = await fetch(url, version, LONG_POLL_S, wait_s + ANSWER_MARGIN_S)
                status = msgspec.json.decode(body, type=AgentStatus)
            except (PollFailed, msgspec.DecodeError) as exc:
                error = printable(str(exc) or type(exc).__name__)[:200]
                if peer.unanswered(error, trio.current_time()):
                    if peer.lost is not None:
                        self.log.warning("head: %s: %s", name, peer.lost)
                    else:
                        self.log.warning("head: %s unreachable at %s: %s", name, url, error)
                    self.on_change()
                version = -1
                # A lost peer is still asked, less often: it may come back (a rejoin).
                await trio.sleep(IDLE_POLL_S if peer.lost is not None else RETRY_S)
                continue
            if peer.failed_polls >= UNREACHABLE_AFTER_POLLS:
                self.log.info("head: %s answers again at %s", name, url)
            version = status.version
            if peer.observe(status, trio.current_time()):
                self.on_change()  # an answer that changed nothing does not wake the head
