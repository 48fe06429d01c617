"""An engine writing 64 KiB at a time through the agent's log pump, beside the same engine writing
straight to a file in the same folder (same disk); pairs interleaved."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.bench.fakes import ENGINE_64K
from tests.bench.procs import PY, REPO, env
from tests.bench.results import Figure

MIB = 1024 * 1024


def _direct(total: int, folder: Path) -> float:
    """Seconds for the engine to write ``total`` bytes straight to a file."""
    start = time.perf_counter()
    with open(folder / "direct.log", "wb") as out:
        subprocess.run([PY, "-c", ENGINE_64K, str(total)], stdout=out, check=True)
    return time.perf_counter() - start


def _through_agent(total: int, folder: Path) -> dict[str, float]:
    """The pump's own report (seconds from the engine's start to the last line in the file)."""
    done = subprocess.run(
        [PY, "-m", "tests.bench.fakes", "pump", str(total), str(folder)],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout)
    return result


def measure(names: set[str], *, quick: bool) -> list[Figure]:
    """log_pump_ratio_64k (median of the pairs' ratios) and log_pump_drop_pct (worst pair)."""
    pairs, total = (2, 64 * MIB) if quick else (5, 256 * MIB)
    ratios, drops, direct_rates = [], [], []
    with tempfile.TemporaryDirectory(prefix="tilert-bench-pump-") as tmp:
        for i in range(pairs):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            direct = _direct(total, folder)
            agent = _through_agent(total, folder)
            lines = agent["lines_written"] + agent["lines_dropped"]
            ratios.append(direct / agent["seconds"])
            drops.append(100.0 * agent["lines_dropped"] / lines)
            direct_rates.append(total / direct / 1e6)
            shutil.rmtree(folder)
    note = (
        f"{total // MIB} MiB per run; straight to the file: "
        + ", ".join(f"{r:.0f}" for r in direct_rates)
        + " MB/s"
    )
    figures = []
    if "log_pump_ratio_64k" in names:
        figures.append(
            Figure(
                "log_pump_ratio_64k",
                ratios,
                "straight to a file (ratio 1)",
                [1.0] * pairs,
                note=note,
            )
        )
    if "log_pump_drop_pct" in names:
        figures.append(
            Figure(
                "log_pump_drop_pct",
                drops,
                "straight to a file drops nothing",
                [0.0] * pairs,
                statistic="max",
            )
        )
    return figures
