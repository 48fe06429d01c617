"""``J/pool.json`` and the pool's arithmetic: which decodes a ``scale`` adds or takes out, which
the head starts joining or asks to leave (agent.job.pool, agent.head.pool)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.head.pool import Membership, PoolFile
from agent.job.paths import JobDir
from agent.job.pool import (
    DecodePool,
    PoolFileError,
    decode_pool,
    every_agent,
    read_pool,
    resized,
    write_pool,
)


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
