"""The front door's own cost beside the floors (issues 28 and 38), in one interleaved run: a local
mock job (1 prefill + 2 decodes, TileRT's real router when one is found as for the chaos
benchmark, the stand-in decode streaming without delay) and, before the same router, the front
(status.json ``front_url``), a bare pass-through on trio (``tests/bench/passthrough.py``), nginx
(``proxy_buffering off``) and HAProxy (``option http-no-delay``), and a service front in a process
of its own whose one cell is the job (``tests/bench/servicealone.py``: service front + the job's
front door, both processes' CPU its cost); each round sends the same
request to every path and straight to the router, the order turned every round.

- ``front_added_ms_p50`` / ``_p95``: per round of the same 64-token streamed chat, a path's
  end-to-end time minus the router's;
- ``front_stream_ratio``: per round of a 3,000-token stream (``ignore_eos``), the bytes per second
  through a path over those straight from the router, median;
- ``front_cpu_us_per_event`` / ``front_cpu_s_per_1k``: each proxy process's CPU time (psutil,
  before and after each of its own requests) over the events of the long streams / per 1,000 short
  chats (the front's process is the head agent's: its probes while a request streams are in it);
- ``service_added_ms_p50`` / ``service_cpu_us_per_event``: the same for the service front + cell
  (the service front's process and the head agent's), beside the front door's alone;
- ``front_ttfb_p99_x_nginx``: 32 clients streaming short chats at once through each path in turn,
  the p99 time to the first event, over nginx's;
- ``front_events_per_s``: the front alone in a process of its own (``tests/bench/frontalone.py``)
  before an upstream that costs almost nothing (``tests/bench/sseupstream.py``; the router would
  saturate first), streams read as fast as they come: events per second of the process's own
  CPU (one core's worth); the bare pass-through and the same front served by hypercorn beside it.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from agent.recipe.model import Probe
from tests.bench.chaos import router_python, wait_job_ready
from tests.bench.frontload import chat_body, cpu_s, many_clients, saturate, timed_chat
from tests.bench.procs import PY, REPO, env
from tests.bench.results import Figure, percentile
from tests.infra.haproxy import HAProxy, haproxy_binary
from tests.infra.nginx import Nginx, nginx_binary
from tests.infra.ports import free_port
from tests.kit import FAST, LocalJob, isolated_sets
from tests.kit.waiting import wait_for

LONG_TOKENS = 3000
TTFB_CLIENTS = 32
SATURATION_STREAMS = 32
SATURATION_EVENTS = 2000
SATURATED = ["front", "front-hypercorn", "passthrough"]
STRAIGHT = "straight"
SERVICE = "service+cell"
BOOTSTRAP = 2000


def median_ci(values: list[float], seed: int = 28) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (the pairs' noise, said beside the
    figure: the router's own time varies by tens of ms on a shared 2-core machine)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP))
    return meds[int(0.025 * BOOTSTRAP)], meds[int(0.975 * BOOTSTRAP) - 1]


@dataclass
class Way:
    """One way to the router: its URL, the processes whose CPU is its cost (none: straight), and
    what was measured through it."""

    url: str
    pids: tuple[int, ...] = ()
    short: list[tuple[float, int]] = field(default_factory=list)
    long: list[tuple[float, int]] = field(default_factory=list)
    cpu_short_s: float = 0.0
    cpu_long_s: float = 0.0
    ttfb_s: list[float] = field(default_factory=list)
    refused: int = 0


def _listener_pid(url: str) -> int:
    """The process listening on ``url``'s port (the head agent, for the front)."""
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        address = conn.laddr
        on_port = isinstance(address, tuple) and len(address) == 2 and address[1] == port
        if conn.status == psutil.CONN_LISTEN and on_port and conn.pid is not None:
            return conn.pid
    raise RuntimeError(f"no process listens on {url}")


@contextlib.contextmanager
def program(*argv: str, answers: str) -> Iterator[subprocess.Popen[bytes]]:
    """A bench program of ours (``python -m ...``), started and waited for (``answers``: a URL
    that answers once it serves), ended at the end."""
    proc = subprocess.Popen([PY, *argv], cwd=REPO, stdin=subprocess.DEVNULL)

    def up() -> bool:
        assert proc.poll() is None, f"{argv} exited"
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(answers, timeout=2)
            return True
        return False

    try:
        wait_for(f"{argv[1]} to answer", up, 30.0)
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def _rounds(paths: dict[str, Way], body: dict[str, object], count: int, long: bool) -> None:
    """``count`` rounds of ``body`` through every path, the order turned every round; each
    proxy's CPU over them."""
    names = list(paths)
    timeout = httpx.Timeout(30.0, read=120.0)
    clients = {name: httpx.Client(timeout=timeout) for name in names}
    try:
        for name in names:  # warm: connections, caches
            timed_chat(clients[name], paths[name].url, body)
        for i in range(count):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                way = paths[name]
                # The proxy's CPU over its own requests only: the head's process (the front's)
                # spends about 1% of a core on its probes meanwhile, which over the other
                # paths' requests too would be a third of its figure.
                before = sum(cpu_s(pid) for pid in way.pids)
                (way.long if long else way.short).append(timed_chat(clients[name], way.url, body))
                used = sum(cpu_s(pid) for pid in way.pids) - before
                if long:
                    way.cpu_long_s += used
                else:
                    way.cpu_short_s += used
    finally:
        for client in clients.values():
            client.close()


def _ttfb(paths: dict[str, Way], body: dict[str, object], each: int) -> None:
    """32 clients at once through each path in turn, twice, in turned orders."""
    names = list(paths)
    for order in (names, names[::-1]):
        for name in order:
            reads = many_clients(paths[name].url, body, TTFB_CLIENTS, each)
            # A refusal (the router's 429 or 503 passed on: only the front queues) is counted,
            # its time left out.
            paths[name].refused += sum(not r.ok for r in reads)
            paths[name].ttfb_s += [r.ttfb_s for r in reads if r.ok]


def _added(paths: dict[str, Way], name: str) -> list[float]:
    direct = paths[STRAIGHT].short
    return [(t - d) * 1000 for (t, _), (d, _) in zip(paths[name].short, direct, strict=True)]


def _ratios(paths: dict[str, Way], name: str) -> list[float]:
    pairs = zip(paths[name].long, paths[STRAIGHT].long, strict=True)
    return [(fs / ft) / (ds / dt) for (ft, fs), (dt, ds) in pairs]


def side_by_side(paths: dict[str, Way], long_events: int) -> str:
    """Every path's figures, one line each (printed and in the notes)."""
    lines = []
    for name, p in paths.items():
        added = _added(paths, name) if name != STRAIGHT else [0.0]
        cells = [
            f"{name}: +{statistics.median(added):.2f} ms p50, +{percentile(added, 0.95):.2f} p95",
            f"ratio {statistics.median(_ratios(paths, name)):.2f}",
            f"ttfb p99 {percentile(p.ttfb_s, 0.99) * 1000:.1f} ms ({p.refused} refused)",
        ]
        if p.pids:
            cells.append(f"{p.cpu_long_s / long_events * 1e6:.0f} us/event")
            cells.append(f"{p.cpu_short_s / len(p.short) * 1000:.2f} s/1k")
        lines.append(", ".join(cells))
    return "; ".join(lines)


def measure_paths(names: set[str], *, quick: bool) -> list[Figure]:
    """The figures measured before the job's router, every path side by side."""
    python = router_python()
    which = "TileRT's router" if python else "the router stand-in (no router venv)"
    short_rounds, long_rounds, ttfb_each = (40, 3, 2) if quick else (200, 6, 4)
    with tempfile.TemporaryDirectory(prefix="tilert-bench-front-") as tmp:
        # The probes at their default pace: the front shares the head's process with the
        # supervisors probing the prefill engine and the router (docs/performance.md).
        probe = f"agent.probe.interval_s={Probe().interval_s:g}"
        args, _ = isolated_sets(python, *FAST, probe, "agent.probe.timeout_s=5")
        with contextlib.ExitStack() as stack:
            job = stack.enter_context(LocalJob(Path(tmp) / "job", args, env=env()))
            status = wait_job_ready(job)
            front, router, model = status.get("front_url"), status["router_url"], status["model"]
            if not isinstance(front, str) or not isinstance(router, str):
                raise RuntimeError("status.json has no front_url: this job has no front door")
            assert isinstance(model, str)
            head = _listener_pid(front)
            paths = {STRAIGHT: Way(router), "front": Way(front, (head,))}
            port = free_port()
            service = stack.enter_context(
                program(
                    "-m",
                    "tests.bench.servicealone",
                    str(port),
                    str(job.job),
                    answers=f"http://127.0.0.1:{port}/health",
                )
            )
            paths[SERVICE] = Way(f"http://127.0.0.1:{port}", (service.pid, head))
            port = free_port()
            bare = stack.enter_context(
                program(
                    "-m",
                    "tests.bench.passthrough",
                    str(port),
                    router.rsplit(":", 1)[1],
                    answers=f"http://127.0.0.1:{port}/health",
                )
            )
            paths["passthrough"] = Way(f"http://127.0.0.1:{port}", (bare.pid,))
            if nginx_binary() is not None:
                ngx = stack.enter_context(Nginx(router, Path(tmp) / "nginx"))
                assert ngx.proc is not None
                paths["nginx"] = Way(ngx.url, (ngx.proc.pid,))
            if haproxy_binary() is not None:
                hap = stack.enter_context(HAProxy(router, Path(tmp) / "haproxy"))
                assert hap.proc is not None
                paths["haproxy"] = Way(hap.url, (hap.proc.pid,))
            short = chat_body(model, 64, long=False)
            _rounds(paths, short, short_rounds, long=False)
            _rounds(paths, chat_body(model, LONG_TOKENS, long=True), long_rounds, long=True)
            _ttfb(paths, short, ttfb_each)
            job.stop(60)
    note = f"{which}; {short_rounds} rounds short, {long_rounds} long; " + side_by_side(
        paths, long_rounds * (LONG_TOKENS + 2)
    )
    return _path_figures(paths, names, note, long_rounds * (LONG_TOKENS + 2))


def _path_figures(paths: dict[str, Way], names: set[str], note: str, events: int) -> list[Figure]:
    """The front's figures among ``names``, each beside its reference."""
    front, bare = paths["front"], paths["passthrough"]
    added = _added(paths, "front")
    low, high = median_ci(added)
    direct_ms = [t * 1000 for t, _ in paths[STRAIGHT].short]
    figures = [
        Figure(
            "front_added_ms_p50",
            added,
            "straight to the router (ms)",
            direct_ms,
            note=f"95% interval of the p50 {low:.2f} .. {high:.2f} ms; {note}",
        ),
        Figure("front_added_ms_p95", added, "straight (ms)", direct_ms, statistic="p95"),
        Figure(
            "front_stream_ratio",
            _ratios(paths, "front"),
            "the bare pass-through's",
            _ratios(paths, "passthrough"),
        ),
        Figure(
            "front_cpu_us_per_event",
            [front.cpu_long_s / events * 1e6],
            "the bare pass-through (us)",
            [bare.cpu_long_s / events * 1e6],
        ),
        Figure(
            "front_cpu_s_per_1k",
            [front.cpu_short_s / len(front.short) * 1000],
            "the bare pass-through (s)",
            [bare.cpu_short_s / len(bare.short) * 1000],
        ),
    ]
    service = paths[SERVICE]
    figures += [
        Figure(
            "service_added_ms_p50",
            _added(paths, SERVICE),
            "the front door's alone (ms)",
            added,
        ),
        Figure(
            "service_cpu_us_per_event",
            [service.cpu_long_s / events * 1e6],
            "the front door's alone (us)",
            [front.cpu_long_s / events * 1e6],
        ),
    ]
    if "nginx" in paths:
        nginx_p99 = percentile(paths["nginx"].ttfb_s, 0.99)
        figures.append(
            Figure(
                "front_ttfb_p99_x_nginx",
                [percentile(front.ttfb_s, 0.99) / nginx_p99],
                "nginx's p99 (ms)",
                [nginx_p99 * 1000],
            )
        )
    return [f for f in figures if f.name in names]


def measure_saturation(*, quick: bool) -> Figure:
    """Events per second through the front alone, before an upstream that costs almost nothing;
    beside it the bare pass-through and the front served by hypercorn (``agent/web/server.py``,
    not the fronts' ``agent/web/h11server.py``), the order turned each run; each one's CPU per
    event."""
    runs = 2 if quick else 4
    up = free_port()
    upstream = f"http://127.0.0.1:{up}"
    ports = {name: free_port() for name in SATURATED}
    argv = {
        "front": ["tests.bench.frontalone", str(ports["front"]), upstream],
        "front-hypercorn": [
            "tests.bench.frontalone",
            str(ports["front-hypercorn"]),
            upstream,
            "--hypercorn",
        ],
        "passthrough": ["tests.bench.passthrough", str(ports["passthrough"]), str(up)],
    }
    body = chat_body("m", SATURATION_EVENTS, long=True)
    rates: dict[str, list[float]] = {name: [] for name in SATURATED}
    us: dict[str, list[float]] = {name: [] for name in SATURATED}
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            program("-m", "tests.bench.sseupstream", str(up), answers=f"{upstream}/health")
        )
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        pids = {
            name: stack.enter_context(
                program("-m", *argv[name], answers=f"{urls[name]}/health")
            ).pid
            for name in SATURATED
        }
        for i in range(runs):
            shift = i % len(SATURATED)
            for name in SATURATED[shift:] + SATURATED[:shift]:
                before = cpu_s(pids[name])
                events, failed, took = saturate(urls[name], body, SATURATION_STREAMS)
                if failed:
                    raise RuntimeError(f"{failed} saturating streams through {name} failed")
                rates[name].append(events / took)
                us[name].append((cpu_s(pids[name]) - before) / events * 1e6)
    # The figure is per second of the process's own CPU (a whole core's worth): on a shared
    # machine the wall-clock rate says how much CPU the process was given, not what it costs.
    note = f"{SATURATION_STREAMS} streams of {SATURATION_EVENTS} events at once; " + "; ".join(
        f"{name} {statistics.median(us[name]):.0f} us CPU per event, "
        f"{statistics.median(rates[name]):.0f}/s of wall clock"
        for name in SATURATED
    )
    return Figure(
        "front_events_per_s",
        [1e6 / u for u in us["front"]],
        "the bare pass-through (/s)",
        [1e6 / u for u in us["passthrough"]],
        note=note,
    )


def measure(names: set[str], *, quick: bool) -> list[Figure]:
    """The front's cost figures among ``names``."""
    figures = []
    if names - {"front_events_per_s"}:
        figures += measure_paths(names, quick=quick)
    if "front_events_per_s" in names:
        figures.append(measure_saturation(quick=quick))
    return figures
