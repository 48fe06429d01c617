"""``tilert-submit init``: what Slurm prints, read; the commented cluster file it writes; and, on
the local Slurm (marked ``slurm``), a file that passes ``--dry-run`` with a project recipe and runs
a mock job to ``ready``."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest
import yaml

from agent.recipe.cluster import read_cluster
from submit.init import choose_interface, render
from submit.slurm.query import (
    ClusterFacts,
    Node,
    combine_partitions,
    gpus_in_gres,
    parse_config,
    parse_records,
    parse_sinfo,
    plugstack_mentions_pyxis,
)
from tests import kit
from tests.infra.slurm import LocalSlurm

SINFO = "gpu*|up|4:00:00|16|gpu:h100:8(S:0-1)|gpu[001-016]\ncpu|up|infinite|4|(null)|c[1-4]\n"
PARTITIONS = (
    "PartitionName=gpu Default=YES DefaultTime=01:00:00 MaxTime=04:00:00 OverSubscribe=EXCLUSIVE "
    "TRES=cpu=12,mem=6000M\nPartitionName=cpu Default=NO DefaultTime=NONE MaxTime=UNLIMITED\n"
)
CONFIG = "KillWait                = 45 sec\nAccountingStorageEnforce = associations,limits\n"


def facts(**kw: object) -> ClusterFacts:
    """A GPU cluster as its commands describe it."""
    out = ClusterFacts(
        config=parse_config(CONFIG),
        partitions=combine_partitions(parse_sinfo(SINFO), parse_records(PARTITIONS)),
        nodes=[Node("gpu001", "10.1.0.1", "gpu:h100:8(S:0-1)", ("gpu",))],
        pyxis=True,
        pyxis_source="`srun --help` lists --container-image",
        accounts=["proj-a", "proj-b"],
    )
    for key, value in kw.items():
        setattr(out, key, value)
    return out


def test_what_slurm_prints_is_read() -> None:
    assert gpus_in_gres("gpu:h100:8(S:0-1)") == 8
    assert gpus_in_gres("gpu:4,shard:16") == 4
    assert gpus_in_gres("(null)") == 0
    parts = facts().partitions
    assert [(p.name, p.default, p.default_time, p.oversubscribe) for p in parts] == [
        ("gpu", True, "01:00:00", "EXCLUSIVE"),
        ("cpu", False, "NONE", "NO"),
    ]
    assert parse_config(CONFIG)["KillWait"] == "45 sec"


def test_a_plugstack_that_includes_pyxis_is_found(tmp_path: Path) -> None:
    (tmp_path / "plugstack.conf.d").mkdir()
    (tmp_path / "plugstack.conf.d" / "pyxis.conf").write_text(
        "required /usr/lib/slurm/spank_pyxis.so\n"
    )
    (tmp_path / "plugstack.conf").write_text("# site plugins\ninclude plugstack.conf.d/*.conf\n")
    assert plugstack_mentions_pyxis(str(tmp_path / "plugstack.conf"))
    (tmp_path / "other.conf").write_text("# pyxis is not here\noptional /x/other.so\n")
    assert not plugstack_mentions_pyxis(str(tmp_path / "other.conf"))


def test_every_value_says_where_it_came_from(tmp_path: Path) -> None:
    text = render(facts(), host="login1", when="now")
    data = yaml.safe_load(text)
    assert data == {
        "default_partition": "gpu",
        "default_time_limit": "01:00:00",
        "default_account": "proj-a",
        "gpus_per_node": 8,
        "kill_wait_s": 45,
        "launcher": "pyxis",
        **({"network_interface": data["network_interface"]} if "network_interface" in data else {}),
    }
    lines = text.splitlines()
    for key in data:
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
        assert lines[at - 1].startswith("#"), f"{key} has no comment saying where it came from"
    # The comments, unwrapped.
    flat = " ".join(line.lstrip("#").strip() for line in lines if line.startswith("#"))
    assert "DefaultTime=01:00:00" in flat
    assert "sacctmgr lists yours: proj-a, proj-b" in flat
    assert "KillWait=45 sec" in flat
    assert "SIGKILL" in flat
    assert "--container-image" in flat
    assert all(len(line) <= 100 for line in lines)
    path = tmp_path / "srtslurm.yaml"
    path.write_text(text)
    cluster, warnings = read_cluster(path)
    assert cluster.launcher == "pyxis"
    assert warnings == []


def test_what_cannot_be_learnt_is_a_question() -> None:
    bare = ClusterFacts(failures={"srun --help": "srun is not on PATH"})
    text = render(bare, host="h", when="now")
    data = yaml.safe_load(text) or {}
    assert "launcher" not in data
    assert "default_partition" not in data
    questions = [line for line in text.splitlines() if line.startswith("# ?")]
    assert any("is pyxis installed?" in q and "srun is not on PATH" in q for q in questions)
    assert any("which partition" in q for q in questions)
    assert any("KillWait" in q for q in questions)


def test_the_interface_on_the_compute_nodes_network_is_chosen() -> None:
    addresses = {
        "eth0": [ipaddress.IPv4Interface("192.0.2.2/24")],
        "ib0": [ipaddress.IPv4Interface("10.1.0.250/16")],
        "lo": [ipaddress.IPv4Interface("127.0.0.1/8")],
    }
    nodes = {"gpu001": ipaddress.IPv4Address("10.1.0.1")}
    chosen, why = choose_interface(addresses, nodes)
    assert chosen == "ib0"
    assert "gpu001" in why
    chosen, why = choose_interface(addresses, {})
    assert chosen is None
    assert "InfiniBand (ib0)" in why


@pytest.mark.slurm
@pytest.mark.router
def test_init_on_the_local_slurm_writes_a_file_that_runs_a_job(
    slurm: LocalSlurm, router_python: Path, tmp_path: Path
) -> None:
    out = tmp_path / "srtslurm.yaml"
    done = kit.submit_cmd("init", "-o", str(out), env=slurm.env)
    assert done.returncode == 0, done.stderr
    assert f"Wrote {out}: launcher process, partition debug" in done.stdout
    text = out.read_text()
    data = yaml.safe_load(text)
    assert data["launcher"] == "process"  # no pyxis on the local Slurm
    assert data["default_partition"] == "debug"
    assert data["kill_wait_s"] == slurm.kill_wait_s
    assert data["gpus_per_node"] == 0
    assert data["network_interface"] == "lo"  # the nodes' NodeAddr is 127.0.0.1
    assert "no --container-image in `srun --help`" in " ".join(text.split())
    # A second init does not replace it without --force.
    again = kit.submit_cmd("init", "-o", str(out), env=slurm.env)
    assert again.returncode == 2
    assert "--force" in again.stderr
    # The file passes --dry-run with a project recipe, then runs a mock job to ready.
    set_args, _ = kit.isolated_sets(router_python)
    dry = kit.submit_cmd(
        str(kit.DEMO_RECIPE), "--dry-run", "--cluster", str(out), "--job-dir",
        str(tmp_path / "dry"), *set_args, env=slurm.env,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    job = tmp_path / "job"
    run = kit.submit_cmd(
        str(kit.DEMO_RECIPE), "--mock", "--cluster", str(out), "--job-dir", str(job),
        *set_args, env=slurm.env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    kit.wait_state(job, "ready", timeout=120)
    slurm_id = kit.current_status(job)["slurm_job_id"]
    stop = kit.submit_cmd("stop", str(job), env=slurm.env, timeout=120)
    assert stop.returncode == 0, stop.stderr
    slurm.wait_job_end(slurm_id, timeout=60)


# A cluster whose Slurm prints Latin-1 (a site's partition and cluster names with an é).
FAKE_SLURM = {
    "sinfo": r"printf 'gpu\351*|up|4:00:00|2|(null)|n[1-2]\n'",
    "scontrol": (
        'case "$2" in\n'
        r"config) printf 'KillWait = 30 sec\nClusterName = caf\351\n' ;;"
        "\n"
        r"partition) printf 'PartitionName=gpu\351 Default=YES DefaultTime=NONE\n' ;;"
        "\n"
        r"node) printf 'NodeName=n1 NodeAddr=127.0.0.1 Gres=(null) Partitions=gpu\351\n' ;;"
        "\n"
        "esac"
    ),
    "srun": r"printf 'Usage: srun [OPTIONS(0)... [executable(0) [args(0)...]]] \351\n'",
}


def test_init_reads_slurm_output_that_is_not_utf8(tmp_path: Path) -> None:
    """Slurm's commands print what the site configured, in its encoding: a byte that is not UTF-8
    is read as U+FFFD (one decoding for every Slurm command, submit/slurm/client.py), never a
    traceback; ``-o -`` prints the file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(0o755)
    env = kit.clean_env(PATH=f"{bin_dir}:/usr/bin:/bin")
    done = kit.submit_cmd("init", "-o", "-", env=env)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    data = yaml.safe_load(done.stdout)
    assert data["default_partition"] == "gpu\ufffd"
    assert data["kill_wait_s"] == 30
    out = tmp_path / "srtslurm.yaml"
    written = kit.submit_cmd("init", "-o", str(out), env=env)
    assert written.returncode == 0, written.stderr
    assert f"Wrote {out}: launcher process, partition gpu\ufffd" in written.stdout
    assert read_cluster(out)[0].default_partition == "gpu\ufffd"
    # A FIFO where the file would go is refused before Slurm is asked.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused = kit.submit_cmd("init", "-o", str(fifo), env=env)
    assert refused.returncode == 2
    assert f"-o {fifo}: exists and is a FIFO, not a regular file" in refused.stderr
