"""This agent's own rendezvous record: its ports, its engines' versions, its last word.

The ports are chosen away from the ports its peers on the same node published (and probed on IPv4
and ``::``, agent.node.ports); an engine port lost to another process before the engine bound it
is moved and republished. Every change is published into ``J/`` at once and, when the write fails,
retried until it succeeds (agent.node.jobwrites): the head cannot find an agent without its record.
"""

from __future__ import annotations

import logging

from agent.job.names import agent_names
from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.records import AgentExit, RendezvousRecord
from agent.node.identity import Identity
from agent.node.jobwrites import JobWrites
from agent.node.ports import choose_ports
from agent.node.rendezvous import read_records, write_record


class OwnRecord:
    """This agent's ports, versions and exit, and their publication in its rendezvous record."""

    def __init__(
        self,
        *,
        job: JobDir,
        plan: Plan,
        identity: Identity,
        bind_host: str,
        writes: JobWrites,
        log: logging.Logger,
    ) -> None:
        self.job = job
        self.plan = plan
        self.id = identity
        self.bind_host = bind_host
        self.writes = writes
        self.log = log
        self.port_base = plan.role(identity.role).port_base
        # The agent's ports (agent, http, ctrl; the head's router), filled as they are chosen.
        self.ports: dict[str, int] = {}
        self.versions: dict[str, str] = {}
        self.exited: AgentExit | None = None

    def peer_ports(self) -> set[int]:
        """The ports the other agents on this node published."""
        names = agent_names(self.plan.prefill.workers, self.plan.decode.workers)
        records = read_records(self.job, set(names)).by_name
        return {
            port
            for name, rec in records.items()
            if name != self.id.name and rec.node == self.id.node
            for port in rec.ports.values()
        }

    def engine_ports(self) -> dict[str, int]:
        """The engine's ports as chosen now (http, and ctrl for a decode)."""
        return {k: self.ports[k] for k in self.port_base if k != "agent" and k in self.ports}

    def choose_engine_ports(self, avoid: set[int] | None = None) -> None:
        """Pick the engine's ports (probed on IPv4 and ::) away from the peers' and ``avoid``."""
        taken = self.peer_ports() | {self.ports.get("agent", 0)} | (avoid or set())
        wanted = {k: v for k, v in self.port_base.items() if k != "agent"}
        self.ports.update(choose_ports(wanted, taken, offset=self.id.index))

    def move_engine_ports(self) -> None:
        """An engine port was taken before the engine bound it: choose others, republish."""
        old = set(self.engine_ports().values())
        self.choose_engine_ports(avoid=old)
        self.log.warning(
            "%s: engine port taken before it bound (%s); moving to %s and republishing",
            self.id.name,
            sorted(old),
            self.engine_ports(),
        )
        self.publish()

    def publish(self) -> None:
        """Write the record (on port choice, every change of ports, exit); retried while it
        fails."""
        self.writes.write(str(self.job.record(self.id.name)), self._write)

    def _write(self) -> None:
        # Built at each attempt: a retry publishes the ports of now.
        base = f"http://{self.bind_host}:{self.ports['agent']}" if "agent" in self.ports else ""
        write_record(
            self.job,
            RendezvousRecord(
                name=self.id.name,
                role=self.id.role,
                index=self.id.index,
                node=self.id.node,
                address=self.id.address,
                ports=dict(self.ports),
                status_url=f"{base}/status" if base else "",
                metrics_url=f"{base}/metrics" if base else "",
                versions=dict(self.versions),
                exited=self.exited,
            ),
        )
