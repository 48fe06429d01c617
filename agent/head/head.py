"""The head agent's job (prefill-0): gate on every worker, run the router, prove it, keep serving.

Flow: every record present and every worker healthy (seen over each peer's long-polled ``/status``,
not through the shared file system) -> router started at once -> router ``/health`` -> one canary
streaming chat per decode node at once (the router's ``/health`` proves nothing) -> ``ready``.
Then "degrade, don't die": a restarting engine makes the job ``degraded``; a decode that ends
``failed`` is dropped and the router restarted without it; the job fails only when the prefill,
the router, or every decode has failed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import msgspec
import trio

from agent.job.atomicfile import write_atomic
from agent.job.logfiles import log_path
from agent.job.names import ROUTER_NAME
from agent.job.records import AgentStatus, JobAgent, JobState, JobStatus, RendezvousRecord
from agent.launch import preflight
from agent.launch.commands import DecodeEndpoint, arg_value, router_command
from agent.launch.launchers import LaunchSpec
from agent.node.logpump import LogSink
from agent.node.rendezvous import Records, watch_records
from agent.node.supervisor import EngineSupervisor, policy_for

if TYPE_CHECKING:
    from agent.nodeagent import NodeAgent

STATUS_REFRESH_S = 5.0
LONG_POLL_S = 20.0
CANARY_RETRY_S = 0.5


class JobFailed(Exception):
    """The job cannot serve; the message names the agent, the reason and its log."""


@dataclass
class Peer:
    record: RendezvousRecord | None = None
    status: AgentStatus | None = None
    reachable: bool = False
    healthy_seen_at: float | None = None  # monotonic time the head saw it healthy


def _canary_text(line: str) -> str:
    if not line.startswith("data:"):
        return ""
    data = line[5:].strip()
    if data == "[DONE]" or not data:
        return ""
    try:
        chunk = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return ""
    if not isinstance(chunk, dict):
        return ""
    if "error" in chunk:
        raise JobFailed(f"canary got an error chunk from the router: {chunk['error']}")
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text += delta.get("content") or ""
    return text


class Head:
    """Gating, router and job state for one job; owned by prefill-0's NodeAgent."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent
        self.plan = agent.plan
        self.job = agent.job
        self.log = agent.log
        self.expected = [agent.id.name] + [f"decode-{i}" for i in range(self.plan.decode.workers)]
        self.peers: dict[str, Peer] = {name: Peer() for name in self.expected}
        self.record_problems: dict[str, str] = {}
        self.dropped: dict[str, str] = {}
        self.router: EngineSupervisor | None = None
        self.router_decodes: list[str] = []
        self.router_standin = False
        self.state: JobState = "starting"
        self.error: str | None = None
        self.router_url: str | None = None
        self._poke = trio.Event()
        self._stop = trio.Event()
        self._status_written: bytes = b""
        self._followers: set[str] = set()
        self._nursery: trio.Nursery | None = None
        self.started = time.monotonic()
        self.local_pid = self._read_local_pid()

    # ---- signals from the agent ------------------------------------------------------------

    def poke(self) -> None:
        """Something changed: re-evaluate now."""
        self._poke.set()

    def request_stop(self) -> None:
        """SIGTERM/SIGINT: drain and stop."""
        self._stop.set()
        self.poke()

    async def _wait(self, timeout_s: float) -> None:
        with trio.move_on_after(timeout_s):
            await self._poke.wait()
        self._poke = trio.Event()

    # ---- peers -----------------------------------------------------------------------------

    def _on_records(self, records: Records) -> None:
        self.record_problems = records.problems
        for name, record in records.by_name.items():
            peer = self.peers.get(name)
            if peer is None:
                continue
            changed_ports = peer.record is not None and peer.record.ports != record.ports
            peer.record = record
            if changed_ports:
                self.log.info("head: %s republished its ports: %s", name, record.ports)
            if name != self.agent.id.name and name not in self._followers and self._nursery:
                self._followers.add(name)
                self._nursery.start_soon(self._follow, name)
        self._write_targets()
        self.poke()

    async def _follow(self, name: str) -> None:
        """Long-poll a peer's /status forever; each answer is pushed into the gate at once."""
        peer = self.peers[name]
        version = -1
        async with httpx.AsyncClient(timeout=LONG_POLL_S + 10) as client:
            while True:
                assert peer.record is not None
                url = peer.record.status_url
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
                    self.poke()
                    await trio.sleep(0.2)
                    continue
                peer.reachable = True
                version = status.version
                self._observe(peer, status)

    def _observe(self, peer: Peer, status: AgentStatus) -> None:
        if status.state == "healthy" and (peer.status is None or peer.status.state != "healthy"):
            peer.healthy_seen_at = time.monotonic()
        peer.status = status
        self.poke()

    def _peer_state(self, name: str) -> str:
        if name == self.agent.id.name:
            return self.agent.feed.current().state
        peer = self.peers[name]
        if peer.record is None:
            return "missing"
        if peer.status is None:
            return "starting"
        if not peer.reachable:
            # An agent that said it was stopping and is gone has stopped: not a lost peer.
            if peer.status.state in ("stopping", "stopped"):
                return "stopped"
            return "unreachable"
        return peer.status.state

    def _refresh_self(self) -> None:
        me = self.peers[self.agent.id.name]
        status = self.agent.feed.current()
        self._observe(me, status)
        me.reachable = True

    # ---- status.json and targets.json ------------------------------------------------------

    def _agent_entry(self, name: str) -> JobAgent:
        peer = self.peers[name]
        status = self.agent.feed.current() if name == self.agent.id.name else peer.status
        role, _, index = name.rpartition("-")
        state = self._peer_state(name)
        reason = status.reason if status else "no rendezvous record yet"
        if name in self.dropped:
            reason = f"dropped from the router: {self.dropped[name]}"
        return JobAgent(
            name=name,
            role=role,
            index=int(index),
            node=peer.record.node if peer.record else None,
            state=state,
            restarts=status.restarts if status else 0,
            reason=reason,
            log=str(log_path(self.job, name, plan=self.plan)),
            metrics_url=peer.record.metrics_url if peer.record else None,
            status_url=peer.record.status_url if peer.record else None,
        )

    def write_status(self, force: bool = False) -> None:
        """Write status.json when something changed (or when ``force``: the 5 s heartbeat)."""
        me = self.peers[self.agent.id.name].record
        router = None
        if self.router is not None:
            r = self.router.status()
            router = JobAgent(
                name=ROUTER_NAME,
                role="router",
                index=0,
                node=self.agent.id.node,
                state=r.state,
                restarts=r.restarts,
                reason=r.reason,
                log=str(log_path(self.job, ROUTER_NAME, plan=self.plan)),
                metrics_url=me.metrics_url if me else None,
                status_url=me.status_url if me else None,
            )
        status = JobStatus(
            state=self.state,
            model=self.plan.model,
            router_url=self.router_url,
            slurm_job_id=self.agent.id.slurm_job_id,
            local_pid=self.local_pid,
            error=self.error,
            agents=[self._agent_entry(name) for name in self.expected],
            router=router,
        )
        content = msgspec.json.encode(msgspec.structs.replace(status, updated_at=0.0))
        if force or content != self._status_written:
            self._status_written = content
            self.job.write_status(status)
        if self.agent.head_figures is not None:
            self.agent.head_figures.job_state = self.state

    def _read_local_pid(self) -> int | None:
        # The --local supervisor records itself before it starts any agent; keep what it wrote.
        try:
            return self.job.read_status().local_pid
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None

    def _write_targets(self) -> None:
        targets = []
        for name in self.expected:
            record = self.peers[name].record
            if record is None:
                continue
            hostport = record.metrics_url.split("//", 1)[1].split("/", 1)[0]
            # No role/node/slurm_job_id here: the pages carry them (DESIGN.md).
            targets.append({"targets": [hostport], "labels": {"agent": name}})
        write_atomic(self.job.targets, msgspec.json.encode(targets) + b"\n", mode=0o644)

    async def _heartbeat(self) -> None:
        while True:
            await trio.sleep(STATUS_REFRESH_S)
            self.write_status(force=True)

    def _set_state(self, state: JobState, why: str) -> None:
        if state != self.state:
            self.log.info("head: job %s -> %s: %s", self.state, state, why)
            self.state = state
        self.write_status()

    # ---- the router ------------------------------------------------------------------------

    def _decode_endpoints(self) -> list[DecodeEndpoint]:
        endpoints = []
        for name in self.router_decodes:
            record = self.peers[name].record
            assert record is not None
            endpoints.append(
                DecodeEndpoint(record.address, record.ports["ctrl"], record.ports["http"])
            )
        return endpoints

    def _build_router(self) -> LaunchSpec:
        a = self.agent
        cmd = router_command(
            self.plan,
            prefill_url=a.engine_url(""),
            decodes=self._decode_endpoints(),
            host=a.id.address,
            use_standin=self.router_standin,
        )
        return a.launch_spec(ROUTER_NAME, cmd.argv, cmd.env, self.plan.router.image)

    async def _router_preflight(self) -> None:
        """Can this node start the real router? Under --mock a missing one means the stand-in."""
        router = self.plan.router
        paths = []
        model_path = arg_value(router.args, "--model-path") or ""
        if model_path.startswith("/"):
            paths.append(model_path)
        checks = preflight.PreflightChecks(
            python=router.python,
            modules=["tilert.pd_vllm.pd_router"],
            distributions=["tilert"],
            # The stand-ins need no setup; the script belongs to the real images.
            setup_script=None if self.plan.mock else self.plan.setup_script,
            configs_dir=self.plan.configs_dir,
            paths=paths,
        )
        base = self.agent.launch_spec("router-preflight", [], dict(os.environ), router.image)
        result = await preflight.run_preflight(self.agent.launcher, base, checks)
        if result.ok:
            self.log.info("head: the real TileRT router is importable by %s", router.python)
            return
        if self.plan.mock:
            self.router_standin = True
            self.log.warning(
                "head: --mock and %s cannot start the real router (%s): using the router stand-in",
                router.python,
                "; ".join(result.problems),
            )
            return
        raise JobFailed("router preflight failed: " + "; ".join(result.problems))

    async def _start_router(self, last_healthy_at: float) -> None:
        self.router_decodes = [n for n in self.expected[1:] if n not in self.dropped]
        sink = LogSink(
            log_path(self.job, ROUTER_NAME, plan=self.plan),
            max_bytes=self.plan.agent.log_max_bytes,
            backups=self.plan.agent.log_backups,
        )
        self.router = EngineSupervisor(
            name=ROUTER_NAME,
            launcher=self.agent.launcher,
            build=self._build_router,
            health_url=lambda: f"http://{self.agent.id.address}:{self.plan.router.port}/health",
            ports=lambda: {"http": self.plan.router.port},
            policy=policy_for(
                self.plan,
                startup_budget_s=self.plan.router.startup_budget_s,
                stop_grace_s=self.plan.router.stop_grace_s,
            ),
            sink=sink,
            log=self.log,
            on_change=self.agent.changed,
            observe_probe=self.agent.metrics.observer("router"),
        )
        assert self._nursery is not None
        self._nursery.start_soon(self.router.run)
        gate = time.monotonic() - last_healthy_at
        if self.agent.head_figures is not None:
            self.agent.head_figures.gate_latency_s = gate
        self.log.info(
            "head: every worker healthy; router started %.0f ms after the last one (decodes %s)",
            gate * 1000,
            ", ".join(self.router_decodes),
        )

    async def _canaries(self) -> None:
        """One streaming chat per decode node at once; each must generate text."""
        assert self.router_url is not None
        count = len(self.router_decodes)
        deadline = time.monotonic() + self.plan.agent.canary_timeout_s
        latencies: list[float] = []
        body = {
            "model": self.plan.model,
            "messages": [{"role": "user", "content": self.plan.agent.canary_prompt}],
            "max_tokens": self.plan.agent.canary_max_tokens,
            "stream": True,
        }
        errors: list[str] = []

        async def one(client: httpx.AsyncClient, i: int) -> None:
            while True:
                t0 = time.monotonic()
                try:
                    text = ""
                    async with client.stream(
                        "POST", f"{self.router_url}/v1/chat/completions", json=body
                    ) as response:
                        if response.status_code != 200:
                            detail = (await response.aread()).decode(errors="replace")[:300]
                            raise JobFailed(f"router answered {response.status_code}: {detail}")
                        async for line in response.aiter_lines():
                            text += _canary_text(line)
                    if text.strip():
                        latencies.append(time.monotonic() - t0)
                        self.log.info("head: canary %d/%d answered %r", i + 1, count, text[:60])
                        return
                    raise JobFailed("router streamed no text")
                except (JobFailed, httpx.HTTPError) as exc:
                    if time.monotonic() > deadline:
                        errors.append(f"canary {i + 1}: {exc}")
                        return
                    self.log.info("head: canary %d/%d not yet: %s", i + 1, count, exc)
                    await trio.sleep(CANARY_RETRY_S)

        timeout = httpx.Timeout(self.plan.agent.canary_timeout_s, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout) as client, trio.open_nursery() as n:
            for i in range(count):
                n.start_soon(one, client, i)
        if errors:
            raise JobFailed(
                f"the router at {self.router_url} did not serve {count} canary chat requests within "
                f"{self.plan.agent.canary_timeout_s:g}s (agent.canary.timeout_s): {'; '.join(errors)}; "
                f"see {log_path(self.job, ROUTER_NAME, plan=self.plan)}"
            )
        if self.agent.head_figures is not None:
            self.agent.head_figures.canary_latency_s = latencies

    # ---- decisions -------------------------------------------------------------------------

    def _failure_of(self, name: str) -> str:
        entry = self._agent_entry(name)
        return f"{name} on {entry.node or '?'} failed: {entry.reason} (log: {entry.log})"

    def _check_fatal(self) -> None:
        """Raise JobFailed when the job can no longer serve."""
        me = self.agent.id.name
        if self._peer_state(me) == "failed":
            raise JobFailed(self._failure_of(me))
        decodes = self.expected[1:]
        failed = [n for n in decodes if self._peer_state(n) == "failed"]
        if len(failed) == len(decodes):
            raise JobFailed(
                "every decode worker failed: " + "; ".join(map(self._failure_of, failed))
            )
        if self.router is not None and self.router.state == "failed":
            router_log = log_path(self.job, ROUTER_NAME, plan=self.plan)
            raise JobFailed(f"router failed: {self.router.reason} (log: {router_log})")
        if self.record_problems:
            raise JobFailed("; ".join(self.record_problems.values()))
        self._check_versions()

    def _check_versions(self) -> None:
        versions = {
            name: peer.record.versions.get("tilert")
            for name, peer in self.peers.items()
            if peer.record is not None and peer.record.versions.get("tilert")
        }
        prefill = versions.get(self.agent.id.name)
        for name, version in versions.items():
            if prefill and version != prefill:
                raise JobFailed(
                    f"tilert versions differ: {self.agent.id.name} has tilert {prefill}, {name} has "
                    f"tilert {version}; the control protocol needs the same version on both sides: "
                    "use matching prefill and decode images"
                )

    def _gate(self) -> float | None:
        """When every live worker is healthy: the monotonic time the last one turned healthy."""
        self._refresh_self()
        decodes = [n for n in self.expected[1:] if self._peer_state(n) != "failed"]
        names = [self.agent.id.name, *decodes]
        if any(self._peer_state(n) != "healthy" for n in names):
            return None
        seen = [self.peers[n].healthy_seen_at or time.monotonic() for n in names]
        return max(seen)

    def _waiting_for(self) -> str:
        return ", ".join(
            f"{n} ({self._peer_state(n)})"
            for n in self.expected
            if self._peer_state(n) != "healthy"
        )

    async def _bring_up(self) -> bool:
        """Gate, router, canaries. False when a stop was requested first."""
        budget = max(self.plan.prefill.startup_budget_s, self.plan.decode.startup_budget_s)
        deadline = time.monotonic() + budget
        await self._router_preflight()
        while True:
            if self._stop.is_set():
                return False
            self._check_fatal()
            missing = [n for n in self.expected if self._peer_state(n) == "missing"]
            self._set_state("starting" if missing else "waiting", self._waiting_for())
            last = self._gate()
            if last is not None:
                break
            if time.monotonic() > deadline:
                # Name each one with its reason and its log (users act on these, not on a folder).
                late = [
                    self._agent_entry(n) for n in self.expected if self._peer_state(n) != "healthy"
                ]
                raise JobFailed(
                    f"still waiting after the startup budget of {budget:g}s: "
                    + "; ".join(
                        f"{a.name} on {a.node or '?'} {a.state}: {a.reason} (log: {a.log})"
                        for a in late
                    )
                )
            await self._wait(0.5)
        for name in self.expected[1:]:
            if self._peer_state(name) == "failed":
                self.dropped[name] = self._failure_of(name)
        await self._start_router(last)
        self.router_url = f"http://{self.agent.id.address}:{self.plan.router.port}"
        assert self.router is not None
        while self.router.state != "healthy":
            if self._stop.is_set():
                return False
            self._check_fatal()
            await self._wait(0.5)
        await self._canaries()
        self._set_state("degraded" if self.dropped else "ready", "canaries answered")
        self.log.info(
            "READY: %s serving model %r at %s (%d decode node(s)); try: curl -sN %s/v1/chat/completions "
            '-H \'Content-Type: application/json\' -d \'{"model": "%s", "stream": true, '
            '"messages": [{"role": "user", "content": "Hello"}]}\'',
            self.plan.name,
            self.plan.model,
            self.router_url,
            len(self.router_decodes),
            self.router_url,
            self.plan.model,
        )
        return True

    async def _serve(self) -> None:
        """While serving: degrade, drop failed decodes, fail only when nothing can serve."""
        assert self.router is not None
        while not self._stop.is_set():
            self._refresh_self()
            self._check_fatal()
            newly = [
                n
                for n in self.router_decodes
                if self._peer_state(n) == "failed" and n not in self.dropped
            ]
            if newly:
                for name in newly:
                    self.dropped[name] = self._failure_of(name)
                    self.log.warning("head: dropping %s from the router", self.dropped[name])
                self.router_decodes = [n for n in self.router_decodes if n not in self.dropped]
                self.router.relaunch(f"restarting the router without {', '.join(newly)}")
            unhealthy = [
                n
                for n in self.expected
                if n not in self.dropped and self._peer_state(n) != "healthy"
            ]
            if self.router.state != "healthy":
                unhealthy.append(f"router ({self.router.state})")
            if unhealthy or self.dropped:
                why = ", ".join(unhealthy + [f"{n} dropped" for n in self.dropped])
                self._set_state("degraded", why)
            else:
                self._set_state("ready", "every worker and the router healthy")
            await self._wait(1.0)

    async def run(self) -> int:
        """The head's whole life; returns the agent's exit code."""
        code = 0
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(watch_records, self.job, self._on_records)
            nursery.start_soon(self._heartbeat)
            try:
                if await self._bring_up():
                    await self._serve()
            except JobFailed as exc:
                self.error = str(exc)
                self.log.error("head: job failed: %s", exc)
                code = 1
            self.router_url = None
            # Failed is said at once (users read it while we drain); stopping only on request.
            self._set_state("failed" if code else "stopping", self.error or "stop requested")
            await self.agent.stop_all()
            self._set_state("failed" if code else "stopped", self.error or "stopped on request")
            nursery.cancel_scope.cancel()
        return code

    async def stop(self) -> None:
        """Stop the router (first, so no request meets a stopping worker)."""
        if self.router is not None:
            await self.router.stop()
