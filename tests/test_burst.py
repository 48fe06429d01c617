"""A burst at the front of the 1P+2D demo with the REAL TileRT router: admission holds what the
router's two decodes cannot serve at once, in arrival order, and the router lives
(docs/reliability.md, "A burst at the front"; docs/agent.md, "Admission"); and a router starved
by clients that bypass the front is not restarted for it (docs/agent.md, "A starved router").

Arrival order is made known, not guessed: request i+1 is sent only once the front has counted
request i into its admission (``tilert_front_queue_*`` on the head's /metrics), and the burst is
still a burst (hundreds wait at once: the test checks the queue was that long). The order the
front sent them in is read from when each stream's first content reached the client: with two
decodes, a later request can overtake an earlier one only while both are at the router.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests import kit
from tests.kit import FAST
from tests.kit.metrics import find, one, samples
from tests.test_scale import PROBE

pytestmark = pytest.mark.router

READY_S = 120.0
BURST = 500
DECODES = 2  # the demo's
# Short streams keep the wall time modest (500 streams, two at a time, about 40 s), yet long
# enough (32 tokens, 160 ms at a decode) that the burst's arrivals outpace the two decodes whatever
# the front's own cost: with 4 tokens a faster front (or a slower metrics poll between arrivals on
# a loaded machine) served them nearly as they came, and fewer than 100 ever waited.
TOKEN_DELAY = "roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S=0.005"
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32, "stream": True}
HEALTH_BOUND_S = 5.0  # the job's probe timeout (PROBE): /health must answer within it
SERVED_S = 600.0  # the whole burst's bound (a bound, not a speed target)
SLOW_TOKENS = "roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S=0.05"
DIRECT = 60  # direct clients of the router: more than its 40 threads
MAX_WAIT_S = 3.0
SMALL_QUEUE = ("agent.front.queue.max_waiting=2", f"agent.front.queue.max_wait_s={MAX_WAIT_S:g}")
LONG = {  # 20 s a stream at 0.05 s a token
    "messages": [{"role": "user", "content": "Hello"}],
    "max_tokens": 400,
    "ignore_eos": True,
    "stream": True,
}


@dataclass
class Reply:
    """What one client got."""

    index: int
    status: int = 0
    first_content: float | None = None  # trio's clock when its first content arrived
    done: bool = False
    text: str = ""
    errors: list[object] = field(default_factory=list)
    retry_after: str | None = None


@pytest.fixture
def job(router_python: Path, tmp_path: Path) -> Iterator[kit.LocalJob]:
    """A ready 1P+2D demo job with the real router and the default queue bounds."""
    sets, _ = kit.isolated_sets(router_python, *FAST, TOKEN_DELAY, PROBE)
    with kit.LocalJob(tmp_path / "job", sets) as running:
        running.wait_state("ready", timeout=READY_S)
        yield running


def urls(job: kit.LocalJob) -> tuple[str, str, str, str]:
    """The front's URL, the head's /metrics, the router's URL and the served model."""
    status = job.status()
    head = kit.agent_entry(status, "prefill-0")
    return status["front_url"], head["metrics_url"], status["router_url"], status["model"]


async def admitted_so_far(client: httpx.AsyncClient, metrics_url: str) -> tuple[int, int]:
    """(requests the front's admission has counted in so far: let in, waiting or refused;
    requests waiting now)."""
    page = samples((await client.get(metrics_url, timeout=10)).text)
    waiting = int(one(page, "tilert_front_queue_waiting").value)
    let_in = one(page, "tilert_front_queue_wait_seconds_count").value
    refused = sum(s.value for s in find(page, "tilert_front_queue_rejected_total"))
    return int(let_in + refused) + waiting, waiting


async def chat(client: httpx.AsyncClient, url: str, body: dict[str, object], reply: Reply) -> None:
    """One streamed chat; what came back goes into ``reply``."""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        reply.status = response.status_code
        reply.retry_after = response.headers.get("retry-after")
        if response.status_code != 200:
            reply.errors.append((await response.aread()).decode())
            return
        async for line in response.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if data == "[DONE]":
                reply.done = True
            elif data:
                chunk = json.loads(data)
                if "error" in chunk:
                    reply.errors.append(chunk)
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text and reply.first_content is None:
                        reply.first_content = trio.current_time()
                    reply.text += text


async def probe_health(
    client: httpx.AsyncClient, router: str, seen: list[float], failed: list[str]
) -> None:
    """The router's /health every 0.1 s while the burst runs, each within HEALTH_BOUND_S: the
    answers' times in ``seen``, what did not answer 200 in ``failed``."""
    while True:
        t0 = trio.current_time()
        try:
            response = await client.get(f"{router}/health", timeout=HEALTH_BOUND_S)
        except httpx.HTTPError as exc:
            failed.append(repr(exc))
        else:
            seen.append(trio.current_time() - t0)
            if response.status_code != 200:
                failed.append(f"{response.status_code}: {response.text[:200]}")
        await trio.sleep(0.1)


def overtakes(replies: list[Reply]) -> list[int]:
    """For each request, how many that arrived after it got their first content before it."""
    times = [r.first_content or 0.0 for r in replies]
    return [sum(1 for later in times[i + 1 :] if later < t) for i, t in enumerate(times)]


async def test_a_burst_of_500_streams_is_queued_served_in_order_and_the_router_lives(
    job: kit.LocalJob,
) -> None:
    """500 concurrent streaming chats at the front: each answered 200 with a whole stream (none
    refused with the default bounds, none lost), sent in arrival order (each overtaken by at most
    the decodes' count), hundreds waiting at once, the router's /health answering within the
    probe's bound throughout and the router never restarted."""
    front, metrics_url, router, model = urls(job)
    head = kit.agent_status(kit.agent_entry(job.status(), "prefill-0")["status_url"])
    router_pid = head["router"]["pid"]
    body = {**CHAT, "model": model}
    replies = [Reply(i) for i in range(BURST)]
    health: list[float] = []
    unhealthy: list[str] = []
    limits = httpx.Limits(max_connections=BURST + 20, max_keepalive_connections=BURST + 20)
    timeout = httpx.Timeout(SERVED_S, connect=30.0)
    most_waiting = 0
    async with (
        httpx.AsyncClient(limits=limits, timeout=timeout) as client,
        httpx.AsyncClient() as side,
        trio.open_nursery() as outer,
    ):
        outer.start_soon(probe_health, side, router, health, unhealthy)
        base, _ = await admitted_so_far(side, metrics_url)
        with kit.within(SERVED_S, "the burst served"):
            async with trio.open_nursery() as chats:
                for reply in replies:
                    chats.start_soon(chat, client, front, body, reply)
                    while True:  # the next one only once this one is counted in
                        counted, waiting = await admitted_so_far(side, metrics_url)
                        most_waiting = max(most_waiting, waiting)
                        if counted > base + reply.index:
                            break
                        await trio.sleep(0.002)
        outer.cancel_scope.cancel()
    ok = [r for r in replies if r.status == 200 and r.done and r.text and not r.errors]
    refused = [r for r in replies if r.status == 429]
    bad = [r for r in replies if r not in ok and r not in refused]
    print(  # the figures the report quotes
        f"burst: {len(ok)} served, {len(refused)} refused 429, {len(bad)} other; most waiting "
        f"{most_waiting}; /health {len(health)} answers, slowest {max(health, default=0):.3f}s, "
        f"{len(unhealthy)} failed; router restarts {job.status()['router']['restarts']}"
    )
    assert not unhealthy, f"the router's /health failed during the burst: {unhealthy[:5]}"
    assert not bad, f"{len(bad)} replies neither served whole nor 429: {bad[:3]}"
    assert len(ok) + len(refused) == BURST
    assert not refused, "the default bounds (1024 waiting, 300 s) refuse none of 500"
    assert most_waiting >= 100, "the burst did not queue: it tested nothing"
    late = overtakes(replies)
    print(f"order: overtaken at most {max(late)} time(s), {sum(late)} in all")
    assert max(late) <= DECODES, f"served out of arrival order: {late}"
    status = job.status()
    assert status["router"]["restarts"] == 0, status["router"]
    head = kit.agent_status(kit.agent_entry(status, "prefill-0")["status_url"])
    assert head["router"]["pid"] == router_pid
    assert status["state"] == "ready"
    queue = status["front"]["queue"]
    assert queue["capacity"] == DECODES
    assert "queue:" in kit.submit_cmd("status", str(job.job)).stdout


def recovered_and_diagnosed(job: kit.LocalJob, router: str) -> None:
    """Once the direct clients left: the router serves again, never restarted; its log has the
    head's note and ``diagnose`` names it."""
    job.wait_state("ready", timeout=READY_S)
    kit.wait_for(
        "the router's /health again",
        lambda: httpx.get(f"{router}/health", timeout=2).status_code == 200,
        90,
    )
    status = job.status()
    assert status["router"]["restarts"] == 0, status["router"]
    log = Path(status["router"]["log"]).read_text()
    assert "=== router starved: /health did not answer within 2s" in log
    report = json.loads(kit.submit_cmd("diagnose", str(job.job), "--json").stdout)
    entry = next(a for a in report["agents"] if a["role"] == "router")
    assert "router-starved" in [f["signature"] for f in entry["findings"]], entry


def starved_for(status: dict[str, Any]) -> float:
    """How long status.json's router row says it has been starved (0: it is not)."""
    found = re.search(r"starved for (\d+)s", status["router"]["reason"])
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def slow_job(
    router_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[kit.LocalJob]:
    """A ready demo job with slow tokens (a long stream holds a decode for 20 s), a 2 s probe
    timeout, and a queue of 2 for 3 s at most."""
    sets, _ = kit.isolated_sets(
        router_python, *FAST, SLOW_TOKENS, "agent.probe.timeout_s=2", *SMALL_QUEUE
    )
    with kit.LocalJob(tmp_path_factory.mktemp("slow") / "job", sets) as running:
        running.wait_state("ready", timeout=READY_S)
        yield running


async def test_past_the_queues_bounds_429_with_retry_after(slow_job: kit.LocalJob) -> None:
    """Two long streams hold both decodes, two requests wait (max_waiting 2): a fifth is
    answered 429 at once (``full``), the two waiting ones 429 after max_wait_s (``wait``), each
    with Retry-After and OpenAI's error shape; counted on /metrics and in ``status``. Once the
    long streams' clients leave, their slots are free: the next request is served."""
    front, metrics_url, _, model = urls(slow_job)
    short = {**CHAT, "model": model}
    replies = [Reply(i) for i in range(5)]
    served = Reply(5)
    async with (
        httpx.AsyncClient(timeout=120) as client,
        httpx.AsyncClient(timeout=60) as side,
        trio.open_nursery() as longs,
    ):
        base, _ = await admitted_so_far(side, metrics_url)
        for reply in replies[:2]:
            longs.start_soon(chat, client, front, {**LONG, "model": model}, reply)
            await counted_in(side, metrics_url, base + reply.index + 1)
        with kit.within(4 * MAX_WAIT_S, "the fifth refused at once, the waiting ones later"):
            async with trio.open_nursery() as waiters:
                for reply in replies[2:4]:
                    waiters.start_soon(chat, client, front, short, reply)
                    await counted_in(side, metrics_url, base + reply.index + 1)
                await chat(client, front, short, replies[4])
        page = samples((await side.get(metrics_url)).text)
        longs.cancel_scope.cancel()  # the long streams' clients leave
    for reply, reason in ((replies[4], "full"), (replies[2], "wait"), (replies[3], "wait")):
        assert reply.status == 429, reply
        assert reply.retry_after is not None, reply
        assert int(reply.retry_after) >= 1, reply
        error = json.loads(str(reply.errors[0]))["error"]
        assert error["type"] == "rate_limit_exceeded", error
        assert error["reason"] == reason, error
        assert "agent.front.queue.max_wait" in error["message"], error
    assert one(page, "tilert_front_queue_rejected_total", reason="full").value == 1
    assert one(page, "tilert_front_queue_rejected_total", reason="wait").value == 2
    async with httpx.AsyncClient(timeout=60) as client:
        with kit.within(60, "a request served once the long streams' clients left"):
            await chat(client, front, short, served)
    assert served.status == 200, served
    assert served.done, served


async def counted_in(client: httpx.AsyncClient, metrics_url: str, count: int) -> None:
    """Wait (bounded) until the front's admission has counted ``count`` requests in."""
    with kit.within(30, f"{count} requests counted in by the front"):
        while True:
            if (await admitted_so_far(client, metrics_url))[0] >= count:
                return
            await trio.sleep(0.01)


async def test_a_router_starved_by_direct_clients_is_not_restarted_and_diagnose_names_it(
    slow_job: kit.LocalJob,
) -> None:
    """Clients that bypass the front (straight at router_url) can still starve the router: 60
    direct long streams at two decodes hold every one of its threads (--queue-timeout 30), so
    its /health does not answer within the head's probe timeout. The head sees the router's
    event loop answer and does not count it: the router's row says starved for longer than 3
    probe timeouts, it is never restarted, router.log has the note and diagnose names it."""
    job = slow_job
    _, _, router, model = urls(job)
    limits = httpx.Limits(max_connections=DIRECT + 5)
    async with (
        httpx.AsyncClient(limits=limits, timeout=120) as client,
        trio.open_nursery() as nursery,
    ):
        for i in range(DIRECT):
            nursery.start_soon(chat, client, router, {**LONG, "model": model}, Reply(i))
        starved = await trio.to_thread.run_sync(
            lambda: kit.wait_for(
                "the router's row to say starved for 10 s",
                job.status,
                90,
                until=lambda s: starved_for(s) >= 10,
            )
        )
        assert starved["router"]["restarts"] == 0, starved["router"]
        assert starved["router"]["state"] == "healthy"
        nursery.cancel_scope.cancel()  # the clients leave
    recovered_and_diagnosed(job, router)
