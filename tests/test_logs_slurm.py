"""Node-local engine logs on the local 3-node Slurm (docs/logs.md, ``agent.logs.location: node``).

Each agent runs in a step on its own node and keeps its engine's log in ``agent.logs.node_dir``
on that node; ``tilert-submit logs`` reads and follows them through the agents' ``/logs`` with the
same output, and ``-f`` ends with 0 after ``tilert-submit stop``. (The local Slurm's nodes share
this machine's disk; that the command reads through the endpoints, not the files, shows once the
job is over: the files are still there and the agents cannot be reached.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import kit
from tests.infra.slurm import LocalSlurm
from tests.kit.logs import ENGINES, STAMP, Follower, by_source, file_lines, logs
from tests.test_e2e_slurm import READY_S, SlurmJob

pytestmark = [pytest.mark.slurm, pytest.mark.router]

END_S = 30.0


def test_node_local_logs_through_the_agents_on_slurm(
    slurm: LocalSlurm, slurm_cluster_file: Path, router_python: Path, tmp_path: Path
) -> None:
    nodes = tmp_path / "node-disk"
    sets, _ = kit.isolated_sets(
        router_python, "agent.logs.location=node", f"agent.logs.node_dir={nodes}"
    )
    with SlurmJob(slurm, tmp_path / "job", slurm_cluster_file, sets) as job:
        kit.wait_state(job.job, "ready", READY_S)
        kit.check_chat(job.job)
        status = kit.current_status(job.job)
        folder = nodes / job.job.name
        files = {name: folder / name / "engine.log" for name in kit.AGENTS}
        files["router"] = folder / "prefill-0" / "router.log"
        assert sorted(kit.agent_entry(status, n)["node"] for n in kit.AGENTS) == [
            "node1",
            "node2",
            "node3",
        ]
        for entry in status["agents"]:
            assert entry["log"] == str(files[entry["name"]]), entry
            assert not (job.job / "logs" / entry["name"] / "engine.log").exists()
        done = logs(job.job, env=slurm.env)
        assert done.returncode == 0, done.stderr
        shown = by_source(done.stdout.splitlines())
        assert list(shown) == ENGINES
        for name, path in files.items():
            assert shown[name], name
            assert shown[name] == file_lines(path)[: len(shown[name])], name
        stamped = logs(job.job, "decode-*", "-t", "--tail", "1", env=slurm.env).stdout
        assert [x.partition(" | ")[0].strip() for x in stamped.splitlines()] == [
            "decode-0",
            "decode-1",
        ]
        assert all(STAMP.match(x.split(" ")[2]) for x in stamped.splitlines())
        follower = Follower(job.job, env=slurm.env)
        try:
            follower.until(
                lambda s: {x.partition(" | ")[0].strip() for x in s} >= set(ENGINES), "all"
            )
            done = job.cmd("stop", str(job.job))
            assert done.returncode == 0, done.stdout + done.stderr
            assert follower.wait(END_S) == 0, follower.err()
        finally:
            follower.kill()
        for name in ENGINES:
            last = by_source(follower.lines)[name]
            assert any(x.startswith(f"=== {name} stopped on request") for x in last), name
        after = logs(job.job, env=slurm.env)
        assert after.returncode == 1
        for name in kit.AGENTS:
            assert f"{name}: could not reach its agent at http://" in after.stderr
            assert files[name].is_file()
