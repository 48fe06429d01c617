"""The front door's own cost (issue 28), side by side with the router in one job: a local mock
job (1 prefill + 2 decodes, TileRT's real router when one is found as for the chaos benchmark,
the stand-in decode streaming without delay), the same requests sent in turn to the front
(status.json ``front_url``) and straight to the router (``router_url``), one at a time.

- ``front_added_ms_p50``: per pair of the same short streamed chat (the stand-in's whole answer),
  the front's end-to-end time minus the router's, p50;
- ``front_stream_ratio``: per pair of a long stream (``ignore_eos``, thousands of tokens), the
  bytes per second through the front over those straight from the router, median.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from agent.recipe.model import Probe
from tests.bench.chaos import router_python, wait_job_ready
from tests.bench.procs import env
from tests.bench.results import Figure
from tests.kit import FAST, LocalJob, isolated_sets

LONG_TOKENS = 3000
BOOTSTRAP = 2000


def median_ci(values: list[float], seed: int = 28) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (the pairs' noise, said beside the
    figure: the router's own time varies by tens of ms on a shared 2-core machine)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP))
    return meds[int(0.025 * BOOTSTRAP)], meds[int(0.975 * BOOTSTRAP) - 1]


def _chat(client: httpx.Client, url: str, model: str, max_tokens: int, long: bool) -> int:
    """One streamed chat read to its end; the bytes it streamed."""
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    if long:
        body["ignore_eos"] = True
    size = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.read()!r}")
        for chunk in response.iter_raw():
            size += len(chunk)
    return size


def _timed(
    client: httpx.Client, url: str, model: str, max_tokens: int, long: bool
) -> tuple[float, int]:
    start = time.perf_counter()
    size = _chat(client, url, model, max_tokens, long)
    return time.perf_counter() - start, size


def _pairs(
    front: str, router: str, model: str, count: int, max_tokens: int, long: bool
) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """``count`` interleaved pairs (front, router), the order flipped every pair."""
    through: list[tuple[float, int]] = []
    direct: list[tuple[float, int]] = []
    timeout = httpx.Timeout(30.0, read=120.0)
    with httpx.Client(timeout=timeout) as a, httpx.Client(timeout=timeout) as b:
        for url, client in ((front, a), (router, b)):  # warm: connections, caches
            _chat(client, url, model, max_tokens, long)
        for i in range(count):
            order = [(front, a, through), (router, b, direct)]
            for url, client, out in order if i % 2 == 0 else order[::-1]:
                out.append(_timed(client, url, model, max_tokens, long))
    return through, direct


def measure(names: set[str], *, quick: bool) -> list[Figure]:
    """The front's cost figures among ``names``, from one job."""
    python = router_python()
    which = "TileRT's router" if python else "the router stand-in (no router venv)"
    short_pairs, long_pairs = (60, 4) if quick else (400, 12)
    figures = []
    with tempfile.TemporaryDirectory(prefix="tilert-bench-front-") as tmp:
        # The probes at their default pace: the front shares the head's process with the
        # supervisors probing the prefill engine and the router, and FAST's 0.1 s probes (twenty
        # a second) were a third of that process's samples (docs/performance.md, "The front's
        # cost").
        probe = f"agent.probe.interval_s={Probe().interval_s:g}"
        args, _ = isolated_sets(python, *FAST, probe, "agent.probe.timeout_s=5")
        with LocalJob(Path(tmp) / "job", args, env=env()) as job:
            status = wait_job_ready(job)
            front, router, model = status.get("front_url"), status["router_url"], status["model"]
            if not isinstance(front, str) or not isinstance(router, str):
                raise RuntimeError("status.json has no front_url: this job has no front door")
            assert isinstance(model, str)
            if "front_added_ms_p50" in names:
                through, direct = _pairs(front, router, model, short_pairs, 64, long=False)
                added = [(f[0] - d[0]) * 1000 for f, d in zip(through, direct, strict=True)]
                low, high = median_ci(added)
                note = (
                    f"{which}; {short_pairs} pairs of the stand-in's whole answer streamed; "
                    f"95% interval of the p50 {low:.2f} .. {high:.2f} ms; "
                    f"front p50 {statistics.median(t for t, _ in through) * 1000:.2f} ms"
                )
                figures.append(
                    Figure(
                        "front_added_ms_p50",
                        added,
                        "straight to the router (ms)",
                        [t * 1000 for t, _ in direct],
                        note=note,
                    )
                )
            if "front_stream_ratio" in names:
                through, direct = _pairs(front, router, model, long_pairs, LONG_TOKENS, long=True)
                ratios = [
                    (fs / ft) / (ds / dt)
                    for (ft, fs), (dt, ds) in zip(through, direct, strict=True)
                ]
                mb_s = [s / t / 1e6 for t, s in direct]
                note = (
                    f"{which}; {long_pairs} pairs of {LONG_TOKENS}-token streams "
                    f"({statistics.median(s for _, s in direct) / 1e3:.0f} kB each); straight "
                    f"to the router {statistics.median(mb_s):.2f} MB/s"
                )
                figures.append(
                    Figure(
                        "front_stream_ratio",
                        ratios,
                        "straight to the router (MB/s)",
                        mb_s,
                        note=note,
                    )
                )
            job.stop(60)
    return figures
