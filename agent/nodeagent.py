"""One agent on one node: identity -> ports -> record -> endpoint -> preflight -> engine.

The head agent (prefill-0) also runs ``agent.head.Head``, which gates and runs the router. The
agent works without Slurm (systemd, ``--local``): Slurm is one way to start it.
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

from agent.head import Head, HeadContext
from agent.http.asgi import bound_socket, serve
from agent.http.client import open_client
from agent.http.endpoint import LogStreams, StatusFeed, build_app
from agent.http.metrics import AgentMetrics, HeadFigures
from agent.http.reexport import UpstreamMetrics
from agent.job.logfiles import convert_log_path, log_path, make_log_dir
from agent.job.names import BENCHMARK_NAME, ROUTER_NAME, agent_names
from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.records import AgentExit, AgentStatus, EngineStatus, RendezvousRecord
from agent.launch import Launcher, LaunchSpec, make_launcher, preflight
from agent.launch.commands import MANAGED_ENV, Command, decode_command, prefill_command
from agent.launch.enginechecks import (
    connector_choice,
    engine_checks,
    pin_problems,
    pinned,
    with_standin_connector,
)
from agent.launch.pyxis import pyxis_flags
from agent.launch.scratch import Scratch, scratch_root, socket_path_problem
from agent.node.conversion import WeightsGate
from agent.node.identity import Identity
from agent.node.jobwrites import JobWrites
from agent.node.logpump import LogSink
from agent.node.ports import choose_port, choose_ports, is_bindable
from agent.node.rendezvous import read_records, write_record
from agent.node.supervisor import EngineSupervisor, policy_for
from agent.problems import printable

MAX_AGENT_PORT_TRIES = 50


def _first_error(exc: BaseException) -> str:
    """The first leaf of an exception (group), as ``Type: message`` on one line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return printable(f"{type(exc).__name__}: {exc}")


class NodeAgent:
    """The supervisor of one node's engine (and, in prefill-0, of the router)."""

    def __init__(self, *, job: JobDir, plan: Plan, identity: Identity, log: logging.Logger) -> None:
        self.job = job
        self.plan = plan
        self.id = identity
        self.log = log
        self.role = plan.role(identity.role)
        self.launcher: Launcher = make_launcher(
            plan.launcher, slurm_job_id=identity.slurm_job_id, node=identity.node
        )
        self.bind_host = plan.agent.bind or identity.address
        self.ports: dict[str, int] = {}
        self.versions: dict[str, str] = {}
        self.feed = StatusFeed(self._snapshot)
        self.log_streams = LogStreams()
        self.writes = JobWrites(log, self.changed)
        self.exited: AgentExit | None = None
        self.engine: EngineSupervisor | None = None
        self.head: Head | None = None  # prefill-0 only
        self.head_figures = HeadFigures() if identity.is_head else None
        self.metrics = AgentMetrics(
            role=identity.role,
            node=identity.node,
            slurm_job_id=identity.slurm_job_id,
            supervisors=self._supervisors,
            upstream_up=(lambda: self.upstream.up) if identity.role == "prefill" else None,
            head=self.head_figures,
        )
        make_log_dir(job, identity.name, plan)  # node-local with agent.logs.location: node
        self.sink = LogSink(
            log_path(job, identity.name, plan=plan),
            max_bytes=plan.agent.log_max_bytes,
            backups=plan.agent.log_backups,
        )
        self.preflight_failure: str | None = None
        self.start_failure: str | None = None  # why the agent could not start at all
        self.upstream = UpstreamMetrics(
            "",  # set once the http port is known
            self.metrics.base,
            timeout_s=min(2.0, plan.agent.probe_timeout_s),
            reserved_names=(),
        )
        self.client: httpx.AsyncClient  # the agent's one client (agent.http.client), from run()
        self.stop_requested = False
        self.started = time.time()
        self.setup_script: Path | None = None
        # Decode: the weights folder complete (converted once if need be) before the engine.
        self.weights = (
            WeightsGate(
                plan=plan,
                job=job,
                identity=identity,
                launcher=self.launcher,
                launch_spec=self.launch_spec,
                log=log,
                on_change=self.changed,
            )
            if identity.role == "decode"
            else None
        )
        # The engines' temp and cache folders on this node; removed when the agent exits.
        self.scratch = Scratch(scratch_root(job, plan.agent.scratch_dir), identity.name)
        self.connector_standin = False

    # ---- state for /status and metrics ---------------------------------------------------

    def _supervisors(self) -> dict[str, EngineSupervisor]:
        sups: dict[str, EngineSupervisor] = {}
        if self.engine is not None:
            sups["engine"] = self.engine
        if self.head is not None and self.head.router_supervisor is not None:
            sups["router"] = self.head.router_supervisor
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
                    state="failed" if self.preflight_failure else "starting",
                    pid=None,
                    ports={},
                    restarts=0,
                    reason=self.preflight_failure or "preflight",
                    since=self.started,
                    uptime_s=None,
                )
            )
        # The agent's ports (agent, http, ctrl), not only the engine's; the router has its own.
        engine["ports"] = {k: v for k, v in self.ports.items() if k != "router"}
        router = self.head.router_status() if self.head is not None else None
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
        """A supervised state changed: wake long-pollers and the head."""
        self.feed.bump()
        if self.head is not None:
            self.head.poke()

    def _head_context(self, figures: HeadFigures) -> HeadContext:
        return HeadContext(
            plan=self.plan,
            job=self.job,
            identity=self.id,
            log=self.log,
            launcher=self.launcher,
            launch_spec=self.launch_spec,
            own_status=self.feed.current,
            on_change=self.changed,
            prefill_url=lambda: self.engine_url(""),
            figures=figures,
            probe_observer=self.metrics.observer,
            stop_node=self.stop_all,
            writes=self.writes,
            client=self.client,
            scratch_folder=self.scratch.folder,
        )

    # ---- ports and the record --------------------------------------------------------------

    def _peer_ports(self) -> set[int]:
        names = agent_names(self.plan.prefill.workers, self.plan.decode.workers)
        records = read_records(self.job, set(names)).by_name
        return {
            port
            for name, rec in records.items()
            if name != self.id.name and rec.node == self.id.node
            for port in rec.ports.values()
        }

    def _engine_port_names(self) -> dict[str, int]:
        return {k: v for k, v in self.role.port_base.items() if k != "agent"}

    def choose_engine_ports(self, avoid: set[int] | None = None) -> None:
        """Pick the engine's ports (probed on IPv4 and ::) and publish them."""
        taken = self._peer_ports() | {self.ports.get("agent", 0)} | (avoid or set())
        self.ports.update(choose_ports(self._engine_port_names(), taken, offset=self.id.index))

    def publish(self) -> None:
        """Write this agent's rendezvous record (on port choice, every change of ports, exit).

        A failed write is retried until it succeeds: the head cannot find an agent without it.
        """
        self.writes.write(str(self.job.record(self.id.name)), self._write_record)

    def _write_record(self) -> None:
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

    def _bind_agent_socket(self) -> socket.socket:
        avoid = self._peer_ports()
        start = self.role.port_base["agent"] + self.id.index
        for _ in range(MAX_AGENT_PORT_TRIES):
            port = choose_port(start, avoid)
            try:
                return bound_socket(self.bind_host, port)
            except OSError:
                avoid.add(port)  # lost a race with another process: try the next one
        raise OSError(f"no free agent port from {start} on {self.bind_host}")

    def _on_address_in_use(self) -> None:
        old = {v for k, v in self.ports.items() if k in self._engine_port_names()}
        self.choose_engine_ports(avoid=old)
        self.log.warning(
            "%s: engine port taken before it bound (%s); moving to %s and republishing",
            self.id.name,
            sorted(old),
            {k: self.ports[k] for k in self._engine_port_names()},
        )
        self.publish()

    # ---- the engine ------------------------------------------------------------------------

    def engine_url(self, path: str) -> str:
        """A URL on this node's engine HTTP port."""
        return f"http://{self.id.address}:{self.ports['http']}{path}"

    def _engine_command(self) -> Command:
        scratch = self.scratch.folder("engine")
        if self.id.role == "prefill":
            return prefill_command(
                self.plan,
                name=self.id.name,
                host=self.id.address,
                http_port=self.ports["http"],
                scratch=scratch,
            )
        return decode_command(
            self.plan,
            name=self.id.name,
            address=self.id.address,
            http_port=self.ports["http"],
            ctrl_port=self.ports["ctrl"],
            scratch=scratch,
        )

    def _build_engine(self) -> LaunchSpec:
        cmd = self._engine_command()
        env = with_standin_connector(cmd.env) if self.connector_standin else cmd.env
        return self.launch_spec(self.id.name, cmd.argv, env, self.role.image)

    def launch_spec(
        self, name: str, argv: list[str], env: dict[str, str], image: str | None
    ) -> LaunchSpec:
        """A LaunchSpec with the job's mounts and the setup script the preflight found."""
        # Under pyxis the image's own value of a variable wins unless it is named here: name
        # every variable the recipe or the agent sets for the engine.
        ours = {
            *self.plan.prefill.env,
            *self.plan.decode.env,
            *self.plan.router.env,
            *self.plan.prefill.secret_env,
            *self.plan.decode.secret_env,
            *self.plan.router.secret_env,
            *MANAGED_ENV,
            self.plan.visible_devices_env,
        }
        mounts = tuple(self.plan.mounts)
        if self.plan.launcher == "pyxis":
            # The engines' scratch folders must exist inside their containers too.
            mounts += (f"{self.scratch.root}:{self.scratch.root}",)
        return LaunchSpec(
            name=name,
            argv=argv,
            env=env,
            image=image,
            mounts=mounts,
            setup_script=self.setup_script,
            container_env=tuple(sorted(k for k in ours if k in env)),
            container_flags=tuple(pyxis_flags(self.plan)),
        )

    async def run_preflight(self) -> bool:
        """The seconds-long checks before the long load; a failure is final and explained."""
        # The engine's own environment (role env, PATH, PYTHONPATH), as it will run.
        env = self._engine_command().env
        checks = engine_checks(self.plan, self.id.role, env)  # type: ignore[arg-type]
        base = self.launch_spec(f"{self.id.name}-preflight", [], env, self.role.image)
        t0 = time.monotonic()
        result = await preflight.run_preflight(self.launcher, base, checks)
        connector = connector_choice(self.plan, env, result)
        problems = [*result.problems, *([connector.problem] if connector.problem else [])]
        if self.id.role == "prefill" and not self.plan.standin("prefill"):
            problems += [p for p in [socket_path_problem(env)] if p]
        if not self.plan.standin(self.id.role):  # type: ignore[arg-type]
            problems += pin_problems(
                pinned(self.plan), result.versions, image=self.role.image, engine=self.id.role
            )
        if problems:
            self.preflight_failure = "preflight failed: " + "; ".join(problems)
            self.log.error("%s: %s", self.id.name, self.preflight_failure)
            self.changed()
            return False
        self.versions = dict(result.versions)
        self.setup_script = Path(result.setup_script) if result.setup_script else None
        self.connector_standin = connector.use_standin
        if connector.note:
            self.log.warning("%s: %s", self.id.name, connector.note)
        self.log.info(
            "%s: preflight ok in %.2fs (versions %s, setup script %s)",
            self.id.name,
            time.monotonic() - t0,
            self.versions or "none",
            self.setup_script,
        )
        return True

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
        self._last_word(code, reason)
        return code

    def _exit_reason(self, code: int) -> str:
        if code == 0:
            return "stopped on request"
        if self.head is not None and self.head.error:
            return self.head.error
        if self.start_failure or self.preflight_failure:
            return self.start_failure or self.preflight_failure or ""
        if self.engine is not None and self.engine.state == "failed":
            return f"engine failed: {self.engine.reason}"
        return "see its agent.log"

    def _last_word(self, code: int, reason: str) -> None:
        """Publish the record once more with ``exited`` (one attempt: the agent is leaving)."""
        self.exited = AgentExit(state="failed" if code else "stopped", reason=reason, code=code)
        self.publish()

    async def _run(self) -> int:
        if self.id.is_head and not is_bindable(self.plan.router.port):
            error = (
                f"router port {self.plan.router.port} is taken on {self.id.node}; free it or set "
                "agent.router_port (clients rely on this port, so the agent does not move it)"
            )
            self.log.error("%s", error)
            self.start_failure = error
            # Nobody else writes status.json for this job now: say it here, or it stays pending.
            try:
                status = self.job.read_status()
                status.state, status.error, status.updated_at = "failed", error, time.time()
                self.job.write_status(status)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.log.error(
                    "%s: cannot record the failure in %s: %s", self.id.name, self.job.status, exc
                )
            return 1
        sock = self._bind_agent_socket()
        self.ports["agent"] = sock.getsockname()[1]
        self.choose_engine_ports()
        if self.id.is_head:
            self.ports["router"] = self.plan.router.port
        self.publish()
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
        exit_code = 0
        # Built once, off the event loop, before anything probes or polls (agent.http.client).
        async with await open_client() as client, trio.open_nursery() as nursery:
            self.client = client
            app = build_app(
                feed=self.feed,
                metrics_page=self._metrics_page,
                token=self.job.read_token,
                log_files=self._log_files,
                log_streams=self.log_streams,
            )
            await nursery.start(serve, app, sock)
            nursery.start_soon(self._watch_signals, nursery.cancel_scope)
            nursery.start_soon(self.writes.retry)
            if self.head_figures is not None:  # prefill-0, the head agent
                self.head = Head(self._head_context(self.head_figures))
            if await self.run_preflight() and (self.weights is None or await self.weights.ready()):
                self.publish()  # now with the versions the preflight found
                self.engine = EngineSupervisor(
                    name=self.id.name,
                    launcher=self.launcher,
                    build=self._build_engine,
                    health_url=lambda: self.engine_url("/health"),
                    ports=lambda: {k: self.ports[k] for k in self._engine_port_names()},
                    policy=policy_for(
                        self.plan,
                        startup_budget_s=self.role.startup_budget_s,
                        stop_grace_s=self.role.stop_grace_s,
                    ),
                    sink=self.sink,
                    log=self.log,
                    on_change=self.changed,
                    on_address_in_use=self._on_address_in_use,
                    observe_probe=self.metrics.observer("engine"),
                    client=client,
                )
                nursery.start_soon(self.engine.run)
                self.changed()
            if self.head is not None:
                exit_code = await self.head.run()
                await self.stop_all()
                nursery.cancel_scope.cancel()
        if self.engine is not None and self.engine.state == "failed":
            exit_code = exit_code or 1
        if self.preflight_failure or (self.weights is not None and self.weights.failure):
            exit_code = 1
        self.log.info("%s: exiting with code %d", self.id.name, exit_code)
        return exit_code

    async def stop_all(self) -> None:
        """Stop the router (head) first, then the engine; each within its grace."""
        if self.head is not None:
            await self.head.stop()
        if self.engine is not None:
            await self.engine.stop()
        self.changed()
        await self.log_streams.close()  # /logs followers get the engines' last lines

    async def _watch_signals(self, scope: trio.CancelScope) -> None:
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
                    if self.head is not None:
                        self.head.request_stop()  # the head drains and returns from run()
                    else:
                        nursery.start_soon(self._stop_and_cancel, scope)

    async def _stop_and_cancel(self, scope: trio.CancelScope) -> None:
        await self.stop_all()
        scope.cancel()

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
        if self.id.is_head:
            files[ROUTER_NAME] = log_path(self.job, ROUTER_NAME, plan=self.plan)
            files[BENCHMARK_NAME] = log_path(self.job, BENCHMARK_NAME, plan=self.plan)
        if self.weights is not None:
            files["convert"] = convert_log_path(self.job, self.id.name)
        return files
