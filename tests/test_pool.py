"""``J/pool.json`` and the pool's arithmetic: which decodes a ``scale`` adds or takes out, which
the head starts joining or asks to leave (agent.job.pool, agent.head.pool)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from agent.head.pool import Membership, PoolFile
from agent.job.paths import JobDir
from agent.job.pool import (
    MAX_DECODES,
    DecodePool,
    PoolFileError,
    decode_pool,
    every_agent,
    read_pool,
    resized,
    write_pool,
)
from agent.job.records import JobAgent, JobStatus
from agent.node.folderlock import LockInfo
from submit.poollock import pool_lock
from tests import kit


def test_growing_takes_the_lowest_free_indexes() -> None:
    assert resized(DecodePool(decode=[0, 1]), 4, []) == ([2, 3], [])
    assert resized(DecodePool(decode=[0, 2]), 3, []) == ([1], [])


def test_shrinking_takes_the_named_first_then_the_highest() -> None:
    pool = DecodePool(decode=[0, 1, 2, 3])
    assert resized(pool, 2, []) == ([], [2, 3])
    assert resized(pool, 2, [0]) == ([], [0, 3])
    assert resized(pool, 3, [1, 2]) == ([], [1])
    assert resized(pool, 4, [1]) == ([], [])


def test_without_a_file_the_pool_is_the_plans(tmp_path: Path) -> None:
    job = JobDir(tmp_path)
    assert read_pool(job, 2).names == ["decode-0", "decode-1"]
    write_pool(job, DecodePool(decode=[0, 1, 5]))
    assert read_pool(job, 2).names == ["decode-0", "decode-1", "decode-5"]
    assert every_agent(job, 1, 2) == {"prefill-0", "decode-0", "decode-1", "decode-5"}
    assert (job.pool.stat().st_mode & 0o777) == 0o644


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"{", "not a pool file"),
        (b'{"schema": 2, "decode": [0]}', "schema 2"),
        (b'{"decode": []}', "at least one"),
        (b'{"decode": [0, 0]}', "distinct"),
        (b'{"decode": [-1]}', ">= 0"),
        (msgspec.json.encode({"decode": list(range(MAX_DECODES + 1))}), "at most 1024"),
    ],
)
def test_a_bad_pool_file_says_why(data: bytes, says: str) -> None:
    with pytest.raises(PoolFileError, match=says):
        decode_pool(data)


def test_the_head_reads_the_file_only_when_it_changed_and_keeps_a_good_pool(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job = JobDir(tmp_path)
    watched = PoolFile(job, 2, logging.getLogger("test"))
    assert watched.read() is None
    write_pool(job, DecodePool(decode=[0, 1, 2]))
    assert watched.changed()
    pool = watched.read()
    assert pool is not None
    assert pool.names == ["decode-0", "decode-1", "decode-2"]
    assert not watched.changed()
    job.pool.write_text("garbage, and longer than before")
    assert watched.read() is pool  # kept
    assert "cannot be used" in caplog.text


def test_membership_joins_the_new_and_takes_out_the_gone() -> None:
    members = Membership()
    assert members.changes(["decode-0", "decode-1", "decode-2"], ["decode-0", "decode-1"]) == (
        ["decode-2"],
        [],
    )
    members.joining["decode-2"] = 1.0
    # decode-2 still joining and no longer wanted: it leaves too; decode-1 leaves.
    assert members.changes(["decode-0"], ["decode-0", "decode-1"]) == ([], ["decode-1", "decode-2"])
    # A decode still leaving is not taken back until its agent has left.
    members.joining.clear()
    members.leaving["decode-1"] = 2.0
    assert members.changes(["decode-0", "decode-1"], ["decode-0"]) == ([], [])


# ---- tilert-submit scale: its bound and its lock ------------------------------------------------


def scale(job: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``tilert-submit scale J ARGS`` as a user runs it."""
    return kit.submit_cmd("scale", str(job), *args, env=kit.clean_env())


def _row(name: str, role: str, index: int) -> JobAgent:
    pool = "member" if role == "decode" else msgspec.UNSET
    return msgspec.convert(
        {"name": name, "role": role, "index": index, "node": "n1", "state": "healthy",
         "restarts": 0, "reason": "", "log": "", "metrics_url": None, "status_url": None,
         **({"pool": pool} if isinstance(pool, str) else {})},
        JobAgent,
    )  # fmt: skip


def serving(job: Path, members: list[int]) -> None:
    """``status.json`` of a ready ``--local`` job whose pool is ``members``, settled: a ``scale``
    that asks for exactly them returns at once (the test process stands in for the supervisor)."""
    rows = [_row("prefill-0", "prefill", 0), *(_row(f"decode-{i}", "decode", i) for i in members)]
    status = JobStatus(
        state="ready",
        model="m",
        local_pid=os.getpid(),
        agents=rows,
        router=_row("router", "router", 0),
    )
    JobDir(job).write_status(status)


def test_scale_refuses_more_decodes_than_the_bound_before_anything(tmp_path: Path) -> None:
    job = kit.make_job(tmp_path)
    serving(job, [0, 1])
    done = scale(job, "--decode", "1000000000")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--decode 1000000000: at most {MAX_DECODES} decodes" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not JobDir(job).pool.exists()
    assert not JobDir(job).pool_lock.exists()
    # The bound itself is a count a pool may have (the recipe's roles.*.nodes has the same).
    JobDir(job).write_status(JobStatus(state="pending", model="m"))
    at_bound = scale(job, "--decode", str(MAX_DECODES))
    assert at_bound.returncode == 1, at_bound.stderr
    assert "the job is pending" in at_bound.stderr


def test_a_scale_while_another_holds_the_pool_says_so_and_changes_nothing(tmp_path: Path) -> None:
    """The race made deterministic: the test holds ``J/pool.lock`` as a running scale would."""
    job = kit.make_job(tmp_path)
    serving(job, [0, 1, 2])
    with pool_lock(JobDir(job)):
        done = scale(job, "--decode", "3")
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "another tilert-submit scale is changing the pool of this job "
        f"(pid {os.getpid()} on {socket.gethostname()}, since "
    ) in done.stderr, done.stderr
    assert f"if no scale runs, remove {JobDir(job).pool_lock}" in done.stderr
    assert not JobDir(job).pool.exists()  # nothing written
    assert not JobDir(job).pool_lock.exists()  # released by its holder
    # Something else under the lock's name: said, not a traceback.
    JobDir(job).pool_lock.mkdir()
    odd = scale(job, "--decode", "3")
    assert odd.returncode == 1, odd.stdout + odd.stderr
    assert f"{JobDir(job).pool_lock}: Is a directory" in odd.stderr, odd.stderr
    assert not JobDir(job).pool.exists()


def _left_lock(job: Path, *, pid: int, node: str) -> None:
    """``J/pool.lock`` as a scale killed by SIGKILL leaves it."""
    info = LockInfo(
        token="t", agent="tilert-submit scale", node=node, job=str(job), pid=pid, temp="",
        started_at=time.time(),
    )  # fmt: skip
    JobDir(job).pool_lock.write_bytes(msgspec.json.encode(info))


def test_a_lock_left_by_a_dead_scale_of_this_node_is_taken_over(tmp_path: Path) -> None:
    job = kit.make_job(tmp_path)
    serving(job, [0, 1, 2])
    dead = subprocess.Popen(["true"])  # a pid that no longer runs
    dead.wait()
    _left_lock(job, pid=dead.pid, node="elsewhere")
    refused = scale(job, "--decode", "3")
    assert refused.returncode == 1
    assert f"pid {dead.pid} on elsewhere" in refused.stderr  # another node's: never judged here
    _left_lock(job, pid=dead.pid, node=socket.gethostname())
    done = scale(job, "--decode", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert read_pool(JobDir(job), 2).decode == [0, 1, 2]
    assert not JobDir(job).pool_lock.exists()


def test_two_scales_one_after_the_other_both_land(tmp_path: Path) -> None:
    """Each reads the pool the last one wrote, under the lock it releases."""
    job = kit.make_job(tmp_path)
    serving(job, [0, 1, 2])
    first = scale(job, "--decode", "3")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "adding decode-2" in first.stdout
    serving(job, [1, 2])
    second = scale(job, "--decode", "2", "--leave", "decode-0")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "taking out decode-0" in second.stdout
    assert read_pool(JobDir(job), 2).decode == [1, 2]  # the first one's decode-2 kept
    assert not JobDir(job).pool_lock.exists()
