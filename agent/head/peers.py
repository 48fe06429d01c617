"""What the head knows of every agent: its record (where it is) and its live ``/status`` (how it
is).

Records come from the rendezvous folder; states travel over each peer's long-polled ``/status``,
not through the shared file system (which caches attributes for seconds). Every answer wakes the
head at once. The head's own state is read from its own agent, never over HTTP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import msgspec
import trio

from agent.job.logfiles import log_path
from agent.job.names import HEAD_NAME, parse_agent_name
from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.records import AgentStatus, JobAgent, RendezvousRecord
from agent.node.rendezvous import Records, watch_records

LONG_POLL_S = 20.0
RETRY_S = 0.2  # after a failed poll: the peer may be restarting its agent


@dataclass
class Peer:
    """One agent as the head sees it."""

    record: RendezvousRecord | None = None
    status: AgentStatus | None = None
    reachable: bool = False
    healthy_seen_at: float | None = None  # monotonic time the head saw it healthy

    @property
    def state(self) -> str:
        """Its state for the job: its own, or ``missing``, ``starting``, ``unreachable``,
        ``stopped``."""
        if self.record is None:
            return "missing"
        if self.status is None:
            return "starting"
        if not self.reachable:
            # An agent that said it was stopping and is gone has stopped: not a lost peer.
            if self.status.state in ("stopping", "stopped"):
                return "stopped"
            return "unreachable"
        return self.status.state

    def observe(self, status: AgentStatus, now: float) -> None:
        """Take a new ``/status``; note when it turned healthy."""
        if status.state == "healthy" and (self.status is None or self.status.state != "healthy"):
            self.healthy_seen_at = now
        self.status = status


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
    ) -> None:
        self.by_name: dict[str, Peer] = {name: Peer() for name in names}
        self.problems: dict[str, str] = {}
        self.job = job
        # Engine logs may live on each node's disk (agent.logs.location: node): the plan says.
        self.plan = plan
        self.own_status = own_status
        self.log = log
        self.on_change = on_change
        self._followed: set[str] = set()

    # ---- what the head reads ---------------------------------------------------------------

    def state(self, name: str) -> str:
        """The state of agent ``name``; the head's own is read live from its agent."""
        if name == HEAD_NAME:
            return self.own_status().state
        return self.by_name[name].state

    def refresh_own(self) -> None:
        """Take the head's own status into its peer (for the gate's healthy times)."""
        me = self.by_name[HEAD_NAME]
        me.observe(self.own_status(), time.monotonic())
        me.reachable = True

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
        """When the head saw each agent turn healthy (monotonic)."""
        return {n: p.healthy_seen_at for n, p in self.by_name.items()}

    def versions(self) -> dict[str, str]:
        """The tilert version each record names (agents whose preflight found one)."""
        found = {n: r.versions.get("tilert") for n, r in self.records().items()}
        return {n: v for n, v in found.items() if v}

    def entry(self, name: str, dropped: str | None = None) -> JobAgent:
        """The status.json row of ``name``; ``dropped`` is why the router no longer uses it."""
        peer = self.by_name[name]
        status = self.own_status() if name == HEAD_NAME else peer.status
        parsed = parse_agent_name(name)
        if parsed is None:
            raise ValueError(f"not an agent name: {name!r}")
        reason = status.reason if status else "no rendezvous record yet"
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
            log=str(log_path(self.job, name, plan=self.plan)),
            metrics_url=peer.record.metrics_url if peer.record else None,
            status_url=peer.record.status_url if peer.record else None,
            convert=status.convert if status and status.convert else msgspec.UNSET,
        )

    # ---- following -------------------------------------------------------------------------

    async def follow(self, on_records: Callable[[], None]) -> None:
        """Watch the records and long-poll every peer that has one (runs forever).

        ``on_records`` is called after each change of the rendezvous folder.
        """
        async with trio.open_nursery() as nursery:

            def changed(records: Records) -> None:
                self._take(records, nursery)
                on_records()

            nursery.start_soon(watch_records, self.job, changed)

    def _take(self, records: Records, nursery: trio.Nursery) -> None:
        self.problems = records.problems
        for name, record in records.by_name.items():
            peer = self.by_name.get(name)
            if peer is None:
                continue
            changed_ports = peer.record is not None and peer.record.ports != record.ports
            peer.record = record
            if changed_ports:
                self.log.info("head: %s republished its ports: %s", name, record.ports)
            if name != HEAD_NAME and name not in self._followed:
                self._followed.add(name)
                nursery.start_soon(self._poll, name)

    async def _poll(self, name: str) -> None:
        """Long-poll a peer's /status forever; each answer is pushed into the gate at once."""
        peer = self.by_name[name]
        version = -1
        async with httpx.AsyncClient(timeout=LONG_POLL_S + 10) as client:
            while True:
                # Read each time: every republish replaces the record.
                url = self.record(name).status_url
                try:
                    response = await client.get(
                        url, params={"after": version, "timeout": LONG_POLL_S}
                    )
                    response.raise_for_status()
                    status = msgspec.json.decode(response.content, type=AgentStatus)
                except (httpx.HTTPError, msgspec.DecodeError, OSError) as exc:
                    if peer.reachable:
                        self.log.warning("head: %s unreachable at %s: %s", name, url, exc)
                    peer.reachable = False
                    version = -1
                    self.on_change()
                    await trio.sleep(RETRY_S)
                    continue
                peer.reachable = True
                version = status.version
                peer.observe(status, time.monotonic())
                self.on_change()
