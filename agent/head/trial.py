"""Proof of decodes joining the pool before the serving router is restarted with them.

TileRT's router has no membership API and proves nothing about its decodes (its ``/health`` is
constant), so a joining decode is proven the way the job is: by canary chats through a router. A
trial router, on a free port of the head's node and with only the joining decodes in its list, runs
beside the serving one; one canary per joining decode at once (the router gives each request to a
free node, so N concurrent canaries prove N nodes); then the trial router is stopped. Only a decode
that passed goes into the serving router's list. Its output is ``router-trial.log`` beside
``router.log``.
"""

from __future__ import annotations

import httpx
import trio

from agent.head.canaries import Canary, run_canaries
from agent.head.context import HeadContext
from agent.head.decisions import JobFailed
from agent.head.router import decode_endpoints
from agent.job.logfiles import log_path
from agent.job.names import ROUTER_NAME
from agent.job.records import RendezvousRecord
from agent.job.urls import base_url
from agent.launch.commands import router_command
from agent.node.logpump import LogSink
from agent.node.ports import choose_port

TRIAL_NAME = "router-trial"
HEALTH_POLL_S = 0.1


async def _healthy(ctx: HeadContext, url: str, exited: trio.Event) -> None:
    """Wait until the trial router answers ``/health`` (bounded by its startup budget)."""
    budget = ctx.plan.router.startup_budget_s
    with trio.move_on_after(budget):
        while not exited.is_set():
            try:
                response = await ctx.client.get(f"{url}/health", timeout=2.0)
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await trio.sleep(HEALTH_POLL_S)
        raise JobFailed(f"the trial router at {url} exited before it served")
    raise JobFailed(f"the trial router at {url} did not serve within {budget:g}s")


async def prove_joining(
    ctx: HeadContext,
    records: dict[str, RendezvousRecord],
    names: list[str],
    *,
    standin: bool,
) -> list[float]:
    """Canaries through a trial router that lists only ``names``; their latencies, or
    ``JobFailed`` saying why (the trial router's log named)."""
    plan = ctx.plan
    host = ctx.identity.address
    port = choose_port(plan.router.port + 1, {plan.router.port})
    cmd = router_command(
        plan,
        prefill_url=ctx.prefill_url(),
        decodes=decode_endpoints(records, names),
        host=host,
        use_standin=standin,
        scratch=ctx.scratch_folder(TRIAL_NAME) if ctx.scratch_folder else None,
        port=port,
    )
    spec = ctx.launch_spec(TRIAL_NAME, cmd.argv, cmd.env, plan.router.image)
    log_file = log_path(ctx.job, ROUTER_NAME, plan=plan).with_name(f"{TRIAL_NAME}.log")
    sink = LogSink(log_file, max_bytes=plan.agent.log_max_bytes, backups=plan.agent.log_backups)
    url = base_url(host, port)
    ctx.log.info("head: proving %s through a trial router at %s", ", ".join(names), url)
    sink.note(f"=== trial router for {', '.join(names)}: {' '.join(spec.argv)} ===")
    process = await ctx.launcher.start(spec)
    exited = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sink.pump, process.output)

            async def reap() -> None:
                await process.wait()
                exited.set()

            nursery.start_soon(reap)
            try:
                await _healthy(ctx, url, exited)
                return await run_canaries(
                    Canary.for_plan(plan, url),
                    len(names),
                    client=ctx.client,
                    log=ctx.log,
                    router_log=log_file,
                )
            finally:
                with trio.CancelScope(shield=True):
                    await process.stop(plan.router.stop_grace_s)
                nursery.cancel_scope.cancel()
    finally:
        sink.close()
