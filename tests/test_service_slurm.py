"""``tilert-submit serve`` on the real local Slurm with TileRT's real router and the stand-in
engines (docs/service.md): a cell with a three-minute time limit hands over to its successor (a
second Slurm job, submitted before the first one's end) while clients stream at the service front:
0 requests lost, the same address; ``SIGTERM`` to the front then leaves no job in ``squeue``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import kit
from tests.bench.chaosload import ChaosLoad
from tests.infra.ports import free_port
from tests.infra.slurm import LocalSlurm
from tests.kit.scenarios import ANSWER
from tests.kit.service import ServeProc, nothing_left
from tests.kit.waiting import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.router]

READY_S = 150.0  # sbatch, two srun steps, the real router's imports, on 2 shared cores
SUCCESSION_S = 240.0
SIGNAL_LEAD_S = 20
MODEL = "demo-model"


def test_a_slurm_cell_hands_over_to_its_successor_and_stop_leaves_no_job(
    slurm: LocalSlurm, slurm_cluster_file: Path, router_python: Path, tmp_path: Path
) -> None:
    cluster = slurm_cluster_file
    cluster.write_text(cluster.read_text() + f"signal_lead_s: {SIGNAL_LEAD_S}\n")
    port = free_port()
    sets, _ = kit.isolated_sets(
        router_python,
        "roles.decode.nodes=1",
        "roles.decode.workers=1",
        "roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S=0.05",
        # Three minutes; the successor 150 s before the end: 30 s after the start, 70 s before
        # the earliest TERM (the lead, or up to 60 s before it).
        "slurm.time_limit='3'",
        "service.successor_lead_s=150",
        "service.drain_s=15",
        f"service.front.port={port}",
    )
    url = f"http://127.0.0.1:{port}"
    args = ["--cluster", str(cluster), *sets]
    with ServeProc(tmp_path / "S", args, env=slurm.env, local=False) as serve:
        first = serve.wait(
            "a ready cell", lambda s: any(c["state"] == "ready" for c in s["cells"]), READY_S
        )
        job1 = first["cells"][0]["slurm_job_id"]
        assert job1, first
        load = ChaosLoad(url, MODEL, ANSWER, clients=2).start()
        try:
            done = serve.wait("a succession", lambda s: s["successions"] >= 1, SUCCESSION_S)
        finally:
            requests = load.finish()
        lost = [r for r in requests if r.outcome != "ok"]
        assert requests, "no request was made"
        assert not lost, lost[:5]
        cells = {c["name"]: c for c in done["cells"]}
        assert cells["cell-2"]["follows"] == "cell-1", cells
        assert cells["cell-2"]["slurm_job_id"] not in (None, job1), cells
        wait_for(
            "cell-1's job to end",
            lambda: slurm.job_state(job1) in (None, "COMPLETED", "CANCELLED"),
            slurm.kill_wait_s + 60,
        )

        assert serve.stop(180) == 0, serve.output()
        assert serve.service()["state"] == "stopped"
        wait_for("no job in squeue", lambda: not slurm.squeue(), slurm.kill_wait_s + 30)
        assert not nothing_left(serve, 10)
