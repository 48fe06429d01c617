"""The lock on a shared file system that one agent converts a weights folder under
(``agent.node.folderlock``): exclusive, stale on unchanged content, taken over, its siblings.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.node.folderlock import LockInfo, LockLost, StaleWatch, observe, take_over, try_acquire
from agent.node.weightsfolder import (
    Siblings,
)

# ---- the lock -------------------------------------------------------------------------------


def info(token: str) -> LockInfo:
    return LockInfo(
        token=token, agent="decode-0", node="n", job="/j", pid=1, temp="t", started_at=0.0
    )


def test_lock_is_exclusive_and_released(tmp_path: Path) -> None:
    path = tmp_path / ".w.tilert-lock"
    held = try_acquire(path, info("a"))
    assert held is not None
    assert try_acquire(path, info("b")) is None
    seen = observe(path)
    assert seen is not None
    assert seen.info is not None
    assert seen.info.token == "a"
    held.release()
    assert not path.exists()
    assert observe(path) is None


def test_staleness_is_unchanged_content_on_the_waiters_clock(tmp_path: Path) -> None:
    path = tmp_path / ".w.tilert-lock"
    held = try_acquire(path, info("a"))
    assert held is not None
    watch = StaleWatch(stale_s=10.0)
    first = observe(path)
    assert first is not None
    assert not watch.stale(first, now=100.0)
    assert not watch.stale(first, now=109.0)
    held.beat(bytes_written=5, rate_bytes_s=1.0)  # a beat resets the clock
    beaten = observe(path)
    assert beaten is not None
    assert beaten.info is not None
    assert beaten.info.bytes_written == 5
    assert not watch.stale(beaten, now=109.5)
    assert not watch.stale(beaten, now=119.0)
    assert watch.stale(beaten, now=119.6)
    held.release()


def test_take_over_removes_only_the_stale_lock(tmp_path: Path) -> None:
    path = tmp_path / ".w.tilert-lock"
    held = try_acquire(path, info("a"))
    assert held is not None
    stale = observe(path)
    assert stale is not None
    held.beat(bytes_written=1, rate_bytes_s=0.0)  # alive after all: not taken over
    assert not take_over(path, stale)
    assert path.exists()
    held.beat(bytes_written=2, rate_bytes_s=0.0)  # still ours
    fresh = observe(path)
    assert fresh is not None
    assert take_over(path, fresh)
    assert not path.exists()
    newer = try_acquire(path, info("b"))
    assert newer is not None
    with pytest.raises(LockLost):
        held.beat(bytes_written=3, rate_bytes_s=0.0)
    held.release()  # not ours any more: the new holder's file stays
    assert path.exists()
    newer.release()
    assert list(tmp_path.iterdir()) == []  # no stale copies left behind


def test_siblings_and_leftovers(tmp_path: Path) -> None:
    siblings = Siblings(tmp_path / "w")
    siblings.converting("aaa").mkdir()
    siblings.converting("bbb").mkdir()
    siblings.replaced("ccc").mkdir()
    (tmp_path / ".other.tilert-converting-x").mkdir()
    names = sorted(p.name for p in siblings.leftovers(keep="aaa"))
    assert names == [".w.tilert-converting-bbb", ".w.tilert-replaced-ccc"]
    assert siblings.lock.name == ".w.tilert-lock"
