"""One agent on one node: identity -> ports -> record -> endpoint -> preflight -> engine.

What runs beside the engine is the agent's duties (``agent.head.duties``): nothing for a worker;
for the head agent (prefill-0) the ``Head``, which gates and runs the router, and the front door.
The agent works without Slurm (systemd, ``--local``): Slurm is one way to start it.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from pathlib import Path

import httpx
import msgspec
import trio

from agent.errors import EXIT_OK, EXIT_RUNTIME
from agent.head.duties import Duties, HeadDuties
from agent.http.client import open_client
from agent.http.endpoint import LogStreams, StatusFeed, build_app
from agent.http.metrics import AgentMetrics
from agent.http.upstream import UpstreamMetrics
from agent.job.logfiles import convert_log_path, log_path, make_log_dir
from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.records import AgentExit, AgentStatus, EngineStatus
from agent.launch import Launcher, LaunchSpec, make_launcher
from agent.launch.commands import Command, engine_command
from agent.launch.enginechecks import (
    with_standin_connector,
)
from agent.launch.jobspecs import JobSpecs
from agent.launch.scratch import Scratch, scratch_root
from agent.node.conversion import WeightsGate
from agent.node.decodestats import DecodeStats, poll_decode_status
from agent.node.enginepreflight import EnginePreflight
from agent.node.identity import Identity
from agent.node.jobwatch import wait_job_end
from agent.node.jobwrites import JobWrites
from agent.node.leave import LEAVE_IDLE_S, wait_idle
from agent.node.logpump import LogSink
from agent.node.ownrecord import OwnRecord
from agent.node.policy import policy_for
from agent.node.ports import choose_port
from agent.node.sdnotify import Notifier
from agent.node.servicenotes import ServiceNotes, Standing, wedge_on_sigusr2, wedge_seconds
from agent.node.supervisor import EngineSupervisor
from agent.problems import printable
from agent.web.server import bound_socket, serve

MAX_AGENT_PORT_TRIES = 50


def _first_error(exc: BaseException) -> str:
    """The first leaf of an exception (group), as ``Type: message`` on one line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return printable(f"{type(exc).__name__}: {exc}")


def _engine_sink(job: JobDir, identity: Identity, plan: Plan) -> LogSink:
    """The engine's log file (node-local with agent.logs.location: node), rotated by the plan."""
    make_log_dir(job, identity.name, plan)
    return LogSink(
        log_path(job, identity.name, plan=plan),
        max_bytes=plan.agent.log_max_bytes,
        backups=plan.agent.log_backups,
    )


class NodeAgent:
    """The supervisor of one node's engine (and, in prefill-0, of the router)."""

    # A worker that saw its job end (agent.node.jobwatch): why, once it did.
    job_ended: str | None = None

    def __init__(self, *, job: JobDir, plan: Plan, identity: Identity, log: logging.Logger) -> None:
        self.job, self.plan, self.id, self.log = job, plan, identity, log
        self.role = plan.role(identity.role)
        self.launcher: Launcher = make_launcher(
            plan.launcher, slurm_job_id=identity.slurm_job_id, node=identity.node
        )
        self.bind_host = plan.agent.bind or identity.address
        self.feed = StatusFeed(self._snapshot)
        self.log_streams = LogStreams()
        self.writes = JobWrites(log, self.changed)
        # Its ports, versions and last word, published in its rendezvous record.
        self.record = OwnRecord(
            job=job,
            plan=plan,
            identity=identity,
            bind_host=self.bind_host,
            writes=self.writes,
            log=log,
        )
        self.ports = self.record.ports
        self.engine: EngineSupervisor | None = None
        # What runs beside the engine: the head in prefill-0 (agent.head.duties), else nothing.
        self.duties = HeadDuties(job, plan, identity, log) if identity.is_head else Duties()
        # The decode's figures from its REQSTAT lines and /decode_status (tilert_decode_*).
        self.decode_stats = DecodeStats() if identity.role == "decode" else None
        self.metrics = AgentMetrics(
            role=identity.role,
            node=identity.node,
            slurm_job_id=identity.slurm_job_id,
            supervisors=self._supervisors,
            upstream_up=(lambda: self.upstream.up) if identity.role == "prefill" else None,
            head=self.duties.figures,
            decode=self.decode_stats,
            pool=self.duties.pool,
        )
        self.duties.attach(self.metrics)
        self.sink = _engine_sink(job, identity, plan)
        self.start_failure: str | None = None  # why the agent could not start at all
        self.upstream = UpstreamMetrics(
            "",  # set once the http port is known
            self.metrics.base,
            timeout_s=min(2.0, plan.agent.probe_timeout_s),
            reserved_names=(),
        )
        self.client: httpx.AsyncClient  # the agent's one client (agent.http.client), from run()
        self.stop_requested = False
        # A decode asked to leave the pool (tilert-submit scale): how its drain ended, once it did.
        self.leaving: str | None = None
        self._stop_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self.started = time.time()
        # The engines' temp and cache folders on this node; removed when the agent exits.
        self.scratch = Scratch(scratch_root(job, plan.agent.scratch_dir), identity.name)
        # Every process's launch spec (mounts, container env, the setup script once found).
        self.specs = JobSpecs(plan, scratch_root=self.scratch.root)
        # Decode: the weights folder complete (converted once if need be) before the engine.
        self.weights = (
            WeightsGate(
                plan=plan,
                job=job,
                identity=identity,
                launcher=self.launcher,
                launch_spec=self.specs,
                log=log,
                on_change=self.changed,
            )
            if identity.role == "decode"
            else None
        )
        # The checks before the engine's long load (docs/preflight.md).
        self.preflight = EnginePreflight(
            self.record, self.launcher, self.specs, self.scratch.root, self.started, self.changed
        )
        # systemd's readiness, status, watchdog and stop notes (no-ops without NOTIFY_SOCKET).
        self.notes = ServiceNotes(Notifier.from_environ(log), self._standing, log)

    # ---- state for /status and metrics ---------------------------------------------------

    def _supervisors(self) -> dict[str, EngineSupervisor]:
        sups: dict[str, EngineSupervisor] = {}
        if self.engine is not None:
            sups["engine"] = self.engine
        sups.update(self.duties.supervisors())
        return sups

    def _snapshot(self) -> AgentStatus:
        gate = self.weights.status() if self.weights is not None else None
        if self.engine is not None:
            engine = msgspec.structs.asdict(self.engine.status())
        elif gate is not None:
            engine = msgspec.structs.asdict(gate)
        else:
            engine = msgspec.structs.asdict(
                EngineStatus(
                    state="failed" if self.preflight.failure else "starting",
                    pid=None,
                    ports={},
                    restarts=0,
                    reason=self.preflight.failure or "preflight",
                    since=self.started,
                    uptime_s=None,
                )
            )
        # The agent's ports (agent, http, ctrl), not only the engine's; the router has its own.
        engine["ports"] = {k: v for k, v in self.ports.items() if k not in ("router", "front")}
        router = self.duties.router_status()
        return AgentStatus(
            **engine,
            name=self.id.name,
            role=self.id.role,
            index=self.id.index,
            node=self.id.node,
            router=router,
            convert=self.weights.progress() if self.weights is not None else None,
            problems=self.writes.problems(),
        )

    def changed(self) -> None:
        """A supervised state changed: wake long-pollers, the head and systemd's notes."""
        self.feed.bump()
        self.duties.poke()
        self.notes.poke()

    def _standing(self) -> Standing:
        """Where this agent stands, for systemd: the head's is the job's, a worker's its
        engine's (ready once healthy; loading while preflight, conversion or load go on)."""
        standing = self.duties.standing()
        if standing is not None:
            return standing
        status = self._snapshot()
        return Standing(
            status=f"{self.id.name} {status.state}: {status.reason}",
            ready=status.state == "healthy",
            loading=status.state in ("starting", "converting", "restarting"),
        )

    # ---- the engine ------------------------------------------------------------------------

    def engine_url(self, path: str) -> str:
        """A URL on this node's engine HTTP port."""
        return f"http://{self.id.address}:{self.ports['http']}{path}"

    def _engine_command(self) -> Command:
        return engine_command(
            self.plan,
            self.id.role,
            name=self.id.name,
            address=self.id.address,
            ports=self.ports,
            scratch=self.scratch.folder("engine"),
        )

    def _build_engine(self) -> LaunchSpec:
        cmd = self._engine_command()
        env = with_standin_connector(cmd.env) if self.preflight.connector_standin else cmd.env
        return self.specs(self.id.name, cmd.argv, env, self.role.image)

    # ---- main ------------------------------------------------------------------------------

    async def run(self) -> int:
        """Run until stopped (exit 0) or until the job fails (exit 1); then say so in the record
        and remove the scratch.

        The record's last word (``exited``) lets the head take a failed agent as failed at once,
        also when it crashed: an unexpected error is logged with its traceback, not raised.
        """
        try:
            code = await self._run()
        except Exception as exc:
            self.log.exception("%s: crashed", self.id.name)
            code, reason = 1, f"agent crashed: {_first_error(exc)}"
        else:
            reason = self._exit_reason(code)
        finally:
            self.scratch.remove()
            self.notes.notifier.close()
        # The last word: one attempt (the agent is leaving).
        self.record.exited = AgentExit(
            state="failed" if code else "stopped", reason=reason, code=code
        )
        self.record.publish()
        return code

    def _exit_reason(self, code: int) -> str:
        if code == 0:
            return self.leaving or self.job_ended or "stopped on request"
        if self.duties.error:
            return self.duties.error
        if self.start_failure or self.preflight.failure:
            return self.start_failure or self.preflight.failure or ""
        if self.engine is not None and self.engine.state == "failed":
            return f"engine failed: {self.engine.explained_reason()}"
        return "see its agent.log"

    async def _run(self) -> int:
        problem = self.duties.start_problem()
        if problem is not None:
            self.start_failure = problem
            return EXIT_RUNTIME
        sock = self._open_ports()
        exit_code = EXIT_OK
        # Built once, off the event loop, before anything probes or polls (agent.http.client).
        async with await open_client() as client, trio.open_nursery() as nursery:
            self.client = client
            app = build_app(
                feed=self.feed,
                metrics_page=self._metrics_page,
                token=self.job.read_token,
                log_files=self._log_files,
                log_streams=self.log_streams,
                on_leave=self._on_leave if self.id.role == "decode" else None,
            )
            self._nursery, self._stop_scope = nursery, nursery.cancel_scope
            await nursery.start(serve, app, sock)
            nursery.start_soon(self._watch_signals, nursery.cancel_scope)
            if not self.id.is_head:  # the head ends the job; a worker ends with it
                nursery.start_soon(self._end_with_job)
            nursery.start_soon(self.writes.retry)
            self.duties.start(self, nursery)  # prefill-0: the head
            nursery.start_soon(self.notes.run)
            wedge_s = wedge_seconds()
            if wedge_s is not None:  # a test switch (docs/systemd.md)
                nursery.start_soon(wedge_on_sigusr2, wedge_s, self.log)
            if self.decode_stats is not None:  # its REQSTAT lines, its /decode_status
                self.sink.watchers.append(self.decode_stats.feed)
                nursery.start_soon(
                    poll_decode_status,
                    self.decode_stats,
                    self.client,
                    lambda: self.engine_url("/decode_status"),  # its port may move
                    lambda: self.engine is not None and self.engine.state == "healthy",
                )
            if await self.preflight.run(self._engine_command()) and (
                self.weights is None or await self.weights.ready()
            ):
                self._start_engine(nursery)
            code = await self.duties.run()
            if code is not None:  # the head's life ended: the agent's with it
                exit_code = code
                await self.stop_all()
                nursery.cancel_scope.cancel()
        if self.engine is not None and self.engine.state == "failed":
            exit_code = exit_code or EXIT_RUNTIME
        if self.preflight.failure or (self.weights is not None and self.weights.failure):
            exit_code = EXIT_RUNTIME
        self.log.info("%s: exiting with code %d", self.id.name, exit_code)
        return exit_code

    def _open_ports(self) -> socket.socket:
        """Bind the agent's own port, choose the engine's, publish them; the bound socket."""
        avoid = self.record.peer_ports()
        start = self.role.port_base["agent"] + self.id.index
        for _ in range(MAX_AGENT_PORT_TRIES):
            port = choose_port(start, avoid)
            try:
                sock = bound_socket(self.bind_host, port)
                break
            except OSError:
                avoid.add(port)  # lost a race with another process: try the next one
        else:
            raise OSError(f"no free agent port from {start} on {self.bind_host}")
        self.ports["agent"] = sock.getsockname()[1]
        self.duties.bind(self.ports, avoid)  # prefill-0: the router's and the front's
        self.record.choose_engine_ports()
        self.record.publish()
        self.upstream.url = self.engine_url("/metrics")
        self.upstream.reserved_names = frozenset(self.metrics.family_names())
        self.log.info(
            "%s on %s (%s): ports %s, record %s",
            self.id.name,
            self.id.node,
            self.id.address,
            self.ports,
            self.job.record(self.id.name),
        )
        return sock

    def _start_engine(self, nursery: trio.Nursery) -> None:
        """Start supervising the engine (the preflight and the weights let it)."""
        self.record.publish()  # now with the versions the preflight found
        self.engine = EngineSupervisor(
            name=self.id.name,
            launcher=self.launcher,
            build=self._build_engine,
            health_url=lambda: self.engine_url("/health"),
            ports=self.record.engine_ports,
            policy=policy_for(
                self.plan,
                startup_budget_s=self.role.startup_budget_s,
                stop_grace_s=self.role.stop_grace_s,
            ),
            sink=self.sink,
            log=self.log,
            on_change=self.changed,
            on_address_in_use=self.record.move_engine_ports,
            observe_probe=self.metrics.observer("engine"),
            client=self.client,
            where=self.id.role,
        )
        nursery.start_soon(self.engine.run)
        self.changed()

    async def stop_all(self) -> None:
        """Stop the router (head) first, then the engine; each within its grace."""
        self.notes.stopping(self.duties.stop_note())
        await self.duties.stop()
        if self.engine is not None:
            await self.engine.stop()
        self.changed()
        await self.log_streams.close()  # /logs followers get the engines' last lines

    def _on_leave(self) -> str:
        """The head's ``POST /leave``: drain (the engine idle, bounded), then stop; what it does."""
        if self.leaving is not None or self.stop_requested or self._nursery is None:
            return "already leaving or stopping"
        self.leaving = "left the pool (tilert-submit scale): draining"
        self._nursery.start_soon(self._leave)
        return "draining, then stopping"

    async def _leave(self) -> None:
        self.log.info("%s: leaving the pool; waiting until its engine is idle", self.id.name)
        url = self.engine_url("/decode_status")
        how = await wait_idle(self.client, url, LEAVE_IDLE_S, self.log)
        self.leaving = f"left the pool (tilert-submit scale): {how}"
        self.log.info("%s: %s; stopping", self.id.name, self.leaving)
        self.stop_requested = True
        await self.stop_all()
        if self._stop_scope is not None:
            self._stop_scope.cancel()

    async def _end_with_job(self) -> None:
        """Drain and exit once the job has ended, as a signal would make it (agent.node.jobwatch:
        an agent started by hand, by systemd or for a rejoin gets no signal)."""
        why = await wait_job_end(self.job, self.log, self.id.name)
        if self.stop_requested or self.leaving is not None:
            return
        self.stop_requested = True
        self.job_ended = f"stopped with the job: {why}"
        self.log.info("%s: %s; stopping", self.id.name, why)
        self.notes.stopping(f"{why}; stopping the engine")
        await self.stop_all()
        if self._stop_scope is not None:
            self._stop_scope.cancel()

    async def _watch_signals(self, scope: trio.CancelScope) -> None:
        async def stop_and_cancel() -> None:
            await self.stop_all()
            scope.cancel()

        # Keep the receiver open after the first signal: a second TERM must not fall back to the
        # default action and kill the agent in the middle of its drain.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if self.stop_requested:
                        self.log.info("%s: %s received again; already stopping", self.id.name, name)
                        continue
                    self.stop_requested = True
                    self.log.info("%s: %s received; stopping", self.id.name, name)
                    self.notes.stopping(f"{name} received; stopping the engines")
                    if not self.duties.request_stop():  # the head drains, returns from run()
                        nursery.start_soon(stop_and_cancel)

    async def _metrics_page(self, budget_s: float | None) -> str:
        upstream = ""
        if self.id.role == "prefill" and "http" in self.ports:
            upstream = await self.upstream.render(self.client, budget_s=budget_s)
        return self.metrics.render() + upstream

    def _log_files(self) -> dict[str, Path]:
        files = {
            "engine": log_path(self.job, self.id.name, plan=self.plan),
            "agent": log_path(self.job, self.id.name, agent=True),
        }
        files.update(self.duties.log_files())
        if self.weights is not None:
            files["convert"] = convert_log_path(self.job, self.id.name)
        return files
