"""Rendezvous records: atomic rewrites, temp files skipped, and every kind of bad file a problem of
its agent only (never a crash, never another agent's record), retried before it counts."""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from functools import partial
from pathlib import Path

import msgspec
import pytest
import trio
import trio.lowlevel

from agent.job.paths import JobDir
from agent.job.records import AgentExit, JobStatus, RendezvousRecord
from agent.job.vocab import JobState
from agent.node import rendezvous
from agent.node.jobwatch import JobEnd, wait_job_end
from agent.node.rendezvous import (
    FULL_PASS_S,
    MAX_RECORD_BYTES,
    RECENT_S,
    RECORD_RETRY_S,
    STAT_PASS_S,
    RecordReader,
    RecordRetry,
    Records,
    read_records,
    watch_records,
    write_record,
)

NAMES = {"prefill-0", "decode-0", "decode-1", "decode-2"}


@pytest.fixture
def job(tmp_path: Path) -> JobDir:
    """An empty job directory with its rendezvous folder."""
    jd = JobDir(tmp_path)
    jd.rendezvous.mkdir()
    return jd


def record(name: str = "decode-0", http: int = 6100) -> RendezvousRecord:
    """A decode record on 127.0.0.1."""
    return RendezvousRecord(
        name=name,
        role="decode",
        index=int(name.rsplit("-", 1)[1]),
        node="n1",
        address="127.0.0.1",
        ports={"http": http, "ctrl": 5600, "agent": 9200},
        status_url="http://127.0.0.1:9200/status",
        metrics_url="http://127.0.0.1:9200/metrics",
    )


def test_write_then_read(job: JobDir) -> None:
    write_record(job, record())
    got = read_records(job, NAMES)
    assert got.problems == {}
    assert got.by_name["decode-0"].ports["http"] == 6100
    assert oct(job.record("decode-0").stat().st_mode & 0o777) == "0o644"


def test_rewrite_is_atomic_and_leaves_no_temp_files(job: JobDir) -> None:
    write_record(job, record(http=6100))
    path = job.record("decode-0")
    first = path.read_bytes()
    before = path.stat().st_ino
    with path.open("rb") as old:  # a reader mid-read keeps the whole old record
        write_record(job, record(http=6105))
        assert old.read() == first
    assert path.stat().st_ino != before  # replaced by rename, not rewritten in place
    assert read_records(job, NAMES).by_name["decode-0"].ports["http"] == 6105
    assert sorted(os.listdir(job.rendezvous)) == ["decode-0.json"]
    assert (
        msgspec.json.decode(path.read_bytes())["updated_at"]
        >= msgspec.json.decode(first)["updated_at"]
    )


def test_temp_files_are_ignored(job: JobDir) -> None:
    write_record(job, record())
    (job.rendezvous / ".decode-1.json.abc123.tmp").write_text('{"schema": 1, "na')
    (job.rendezvous / "notes.txt").write_text("hello")
    got = read_records(job, NAMES)
    assert list(got.by_name) == ["decode-0"]
    assert got.problems == {}


def test_foreign_schema_and_garbage_are_problems_naming_the_file(job: JobDir) -> None:
    write_record(job, record())
    foreign = job.rendezvous / "decode-1.json"
    data = msgspec.json.decode(msgspec.json.encode(record("decode-1")))
    data["schema"] = 99
    foreign.write_bytes(msgspec.json.encode(data))
    broken = job.rendezvous / "decode-2.json"
    broken.write_text("{not json")
    got = read_records(job, NAMES)
    assert list(got.by_name) == ["decode-0"]
    assert str(foreign) in got.problems["decode-1"]
    assert "99" in got.problems["decode-1"]
    assert str(broken) in got.problems["decode-2"]


def test_missing_folder_is_empty(tmp_path: Path) -> None:
    got = read_records(JobDir(tmp_path / "nothing"), NAMES)
    assert got.by_name == {}
    assert got.problems == {}


# ---- one bad file makes at most its agent's record bad -----------------------------------------


def good_bytes(name: str = "decode-1") -> bytes:
    """What ``write_record`` writes for ``name``."""
    return msgspec.json.encode(record(name))


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "empty"),
        (b"   \n", "empty"),
        (b'{"schema": 1, "name": "deco', "not JSON, or cut short"),  # as NFS shows a half write
        (b"\x00\xff garbage", "not JSON"),
        (b"[1, 2]", "schema None"),
        (b'{"schema": 1, "name": "decode-1"}', "malformed rendezvous record"),
        (b'{"schema": 1, "name": "decode-1"}' + b" " * (MAX_RECORD_BYTES + 1), "larger than"),
    ],
)
def test_a_bad_record_is_a_problem_of_its_agent_only(
    job: JobDir, content: bytes, said: str
) -> None:
    write_record(job, record("decode-0"))
    job.record("decode-1").write_bytes(content)
    got = read_records(job, NAMES)
    assert list(got.by_name) == ["decode-0"]
    assert list(got.problems) == ["decode-1"]
    assert str(job.record("decode-1")) in got.problems["decode-1"]
    assert said in got.problems["decode-1"], got.problems["decode-1"]


def test_a_symlink_is_not_followed_even_to_a_good_record(job: JobDir, tmp_path: Path) -> None:
    elsewhere = tmp_path / "decode-1.json"
    elsewhere.write_bytes(good_bytes())
    job.record("decode-1").symlink_to(elsewhere)
    got = read_records(job, NAMES)
    assert got.by_name == {}
    assert "symbolic link, not followed" in got.problems["decode-1"]


def test_a_fifo_under_a_records_name_does_not_block(job: JobDir) -> None:
    os.mkfifo(job.record("decode-1"))  # opening it for reading would wait for a writer
    got = read_records(job, NAMES)
    assert "not a regular file" in got.problems["decode-1"]


def test_another_agents_record_is_not_accepted_under_this_name(job: JobDir) -> None:
    job.record("decode-1").write_bytes(good_bytes("decode-0"))
    got = read_records(job, NAMES)
    assert got.by_name == {}
    assert "the record of 'decode-0', not of decode-1" in got.problems["decode-1"]


def test_a_record_whose_role_or_index_is_not_its_name_is_refused(job: JobDir) -> None:
    data = msgspec.json.decode(good_bytes("decode-1"))
    data["index"] = 0
    job.record("decode-1").write_bytes(msgspec.json.encode(data))
    data = msgspec.json.decode(good_bytes("decode-2"))
    data["role"] = "prefill"
    job.record("decode-2").write_bytes(msgspec.json.encode(data))
    got = read_records(job, NAMES)
    assert got.by_name == {}
    assert "says role 'decode' index 0, which is not decode-1" in got.problems["decode-1"]
    assert "says role 'prefill' index 2" in got.problems["decode-2"]


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("role", "router", "Invalid enum value 'router' - at `$.role`"),
        ("exited", {"state": "exploded", "reason": "r", "code": 1}, "at `$.exited.state`"),
    ],
)
def test_a_word_outside_the_vocabulary_is_a_problem_of_its_agent_only(
    job: JobDir, field: str, value: object, said: str
) -> None:
    # Roles and states are typed words (agent.job.vocab): a record with another word (a newer or
    # broken agent) is that agent's problem, the others' records are read as before.
    write_record(job, record("decode-0"))
    data = msgspec.json.decode(good_bytes("decode-1"))
    data[field] = value
    job.record("decode-1").write_bytes(msgspec.json.encode(data))
    got = read_records(job, NAMES)
    assert list(got.by_name) == ["decode-0"]
    assert "malformed rendezvous record" in got.problems["decode-1"]
    assert said in got.problems["decode-1"], got.problems["decode-1"]


def test_values_from_a_bad_record_are_shown_escaped(job: JobDir) -> None:
    data = msgspec.json.decode(good_bytes("decode-1"))
    data["name"] = "decode-0\nERROR forged line\x00"
    job.record("decode-1").write_bytes(msgspec.json.encode(data))
    problem = read_records(job, NAMES).problems["decode-1"]
    assert "\n" not in problem
    assert "\x00" not in problem
    assert "'decode-0\\nERROR forged line\\x00'" in problem


def test_files_no_expected_agent_writes_are_strays(job: JobDir) -> None:
    write_record(job, record("decode-0"))
    for stray in ("decode-7.json", "notes.json", "decode-01.json", "prefill-0 copy.json"):
        (job.rendezvous / stray).write_bytes(good_bytes("decode-0"))
    (job.rendezvous / "line\nbreak.json").write_text("x")
    got = read_records(job, NAMES)
    assert list(got.by_name) == ["decode-0"]
    assert got.problems == {}
    assert sorted(got.strays) == sorted(
        [
            "decode-7.json",
            "notes.json",
            "decode-01.json",
            "prefill-0 copy.json",
            "line\\nbreak.json",
        ]
    )


def test_a_removed_folder_reads_as_empty(job: JobDir) -> None:
    write_record(job, record("decode-0"))
    job.rendezvous.rename(job.root / "elsewhere")
    assert read_records(job, NAMES) == Records()


def test_the_last_word_is_written_only_when_there_is_one(job: JobDir) -> None:
    write_record(job, record("decode-0"))
    assert "exited" not in msgspec.json.decode(job.record("decode-0").read_bytes())
    last = record("decode-0")
    last.exited = AgentExit(state="failed", reason="agent crashed: boom", code=1)
    write_record(job, last)
    got = read_records(job, NAMES).by_name["decode-0"]
    assert got.exited is not None
    assert (got.exited.state, got.exited.code) == ("failed", 1)


# ---- transient problems are retried -----------------------------------------------------------


def test_a_problem_counts_only_after_the_retry_and_the_last_good_record_stays(job: JobDir) -> None:
    retry = RecordRetry(retry_s=3.0)
    write_record(job, record("decode-1", http=6100))
    seen = retry.take(read_records(job, NAMES), now=0.0)
    assert seen.by_name["decode-1"].ports["http"] == 6100
    assert seen.problems == {}
    job.record("decode-1").write_bytes(b'{"schema": 1, "na')  # half-written, as NFS shows it
    seen = retry.take(read_records(job, NAMES), now=1.0)
    assert seen.problems == {}
    assert seen.by_name["decode-1"].ports["http"] == 6100
    seen = retry.take(read_records(job, NAMES), now=3.9)
    assert seen.problems == {}
    seen = retry.take(read_records(job, NAMES), now=4.0)
    assert "cut short" in seen.problems["decode-1"]
    assert seen.by_name["decode-1"].ports["http"] == 6100  # still where it was
    write_record(job, record("decode-1", http=6105))
    seen = retry.take(read_records(job, NAMES), now=5.0)
    assert seen.problems == {}
    assert seen.by_name["decode-1"].ports["http"] == 6105


def test_a_problem_that_goes_away_starts_its_retry_afresh(job: JobDir) -> None:
    retry = RecordRetry(retry_s=3.0)
    job.record("decode-1").write_bytes(b"{")
    assert retry.take(read_records(job, NAMES), now=0.0).problems == {}
    job.record("decode-1").unlink()
    assert retry.take(read_records(job, NAMES), now=2.0).problems == {}
    job.record("decode-1").write_bytes(b"{")
    assert retry.take(read_records(job, NAMES), now=4.0).problems == {}
    assert retry.take(read_records(job, NAMES), now=7.0).problems != {}


async def test_the_watcher_reports_a_lasting_problem_once_after_the_retry(
    job: JobDir,
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    write_record(job, record("decode-1"))
    calls: list[tuple[float, Records]] = []

    def changed(records: Records) -> None:
        calls.append((trio.current_time(), records))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_records, job, NAMES, changed)
        await trio.sleep(1.0)
        start = trio.current_time()
        job.record("decode-1").write_text("garbage")
        await trio.sleep(RECORD_RETRY_S + 1.0)
        nursery.cancel_scope.cancel()
    assert len(calls) == 2, calls
    (t0, first), (t1, second) = calls
    assert t0 == 0.0
    assert first.problems == {}
    assert list(first.by_name) == ["decode-1"]
    assert RECORD_RETRY_S <= t1 - start <= RECORD_RETRY_S + 0.3
    assert "not JSON" in second.problems["decode-1"]
    assert list(second.by_name) == ["decode-1"]


# ---- reading only what changed ----------------------------------------------------------------


def counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the records read from now on (each ``read_record`` call)."""
    reads: list[str] = []
    real = rendezvous.read_record

    def counted(path: Path, name: str) -> RendezvousRecord:
        reads.append(name)
        return real(path, name)

    monkeypatch.setattr(rendezvous, "read_record", counted)
    return reads


def settle(job: JobDir) -> None:
    """Make the folder's last change look old (its time stamps are coarse: a fresh change is
    looked at again on every pass)."""
    old = time.time() - 2 * RECENT_S
    os.utime(job.rendezvous, (old, old))


def test_unchanged_records_are_not_read_again(job: JobDir, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("decode-0", "decode-1"):
        write_record(job, record(name))
    settle(job)
    reads = counting_reads(monkeypatch)
    reader = RecordReader(job, NAMES)
    found, changed = reader.read(0.0)
    assert (sorted(found.by_name), changed) == (["decode-0", "decode-1"], True)
    assert sorted(reads) == ["decode-0", "decode-1"]
    reads.clear()
    for now in (0.1, 0.2, STAT_PASS_S + 0.1, FULL_PASS_S - 0.1):
        assert reader.read(now)[1] is False
    assert reads == []  # the folder and every file unchanged: nothing read


def test_a_rewritten_record_is_read_alone_at_once(
    job: JobDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("decode-0", "decode-1"):
        write_record(job, record(name))
    settle(job)
    reader = RecordReader(job, NAMES)
    reader.read(0.0)
    reads = counting_reads(monkeypatch)
    write_record(job, record("decode-1", http=6200))  # by rename, as agents write
    found, changed = reader.read(0.1)
    assert (changed, reads) == (True, ["decode-1"])
    assert found.by_name["decode-1"].ports["http"] == 6200


def test_a_record_changed_in_place_is_seen_by_the_next_stat_pass(
    job: JobDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_record(job, record("decode-1"))
    settle(job)
    reader = RecordReader(job, NAMES)
    reader.read(0.0)
    reads = counting_reads(monkeypatch)
    path = job.record("decode-1")
    path.write_text("garbage")  # in place: the folder does not change, the file's stat does
    assert reader.read(0.1)[1] is False  # between stat passes: not looked at yet
    found, changed = reader.read(STAT_PASS_S)
    assert (changed, reads) == (True, ["decode-1"])
    assert "not JSON" in found.problems["decode-1"]


def test_every_record_is_read_again_on_the_full_pass(
    job: JobDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An NFS client may show a changed file with its old size and mtime (attribute cache): the
    # full pass reads every record whatever the stats say.
    for name in ("decode-0", "decode-1"):
        write_record(job, record(name))
    settle(job)
    reader = RecordReader(job, NAMES)
    reader.read(0.0)
    reads = counting_reads(monkeypatch)
    assert reader.read(FULL_PASS_S)[1] is False  # read again, found the same: no change
    assert sorted(reads) == ["decode-0", "decode-1"]


def test_a_removed_record_and_a_new_stray_are_changes(job: JobDir) -> None:
    write_record(job, record("decode-1"))
    reader = RecordReader(job, NAMES)
    reader.read(0.0)
    job.record("decode-1").unlink()
    (job.rendezvous / "notes.json").write_text("{}")
    found, changed = reader.read(0.1)
    assert (changed, found.by_name, found.strays) == (True, {}, ["notes.json"])


async def test_the_watcher_looks_less_often_once_the_folder_is_quiet_and_at_once_again_after(
    job: JobDir,
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    """Every 0.1 s while records change, every 0.5 s after 5 s without a change, every 0.1 s again
    after the next change (an idle head's CPU; docs/performance.md, "An idle head")."""
    looks: list[float] = []
    changes = [0.0, 10.0]  # the first look at or after each is told a change

    class Reader(RecordReader):
        def read(self, now: float) -> tuple[Records, bool]:
            looks.append(now)
            found, _ = super().read(now)
            if changes and now >= changes[0]:
                changes.pop(0)
                return found, True
            return found, False

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(watch_records, reader=Reader(job, NAMES)), job, NAMES, print)
        await trio.sleep(12.0)
        nursery.cancel_scope.cancel()
    gaps = [(round(a, 3), round(b - a, 3)) for a, b in itertools.pairwise(looks)]
    changed_again = next(t for t in looks if t >= 10.0)
    busy = [g for t, g in gaps if t < 4.9 or changed_again <= t < 11.9]
    quiet = [g for t, g in gaps if 5.2 <= t < 9.5]
    assert changed_again < 10.5, gaps  # the slow look saw the change within its 0.5 s
    assert set(busy) == {0.1}, gaps
    assert set(quiet) == {0.5}, gaps


# ---- the job's end as a worker agent sees it (agent.node.jobwatch) ------------------------------


def _status(job: JobDir, state: JobState, *, spaced: bool = False) -> None:
    """status.json in ``state``: as the head writes it, or as another tool would (spaced)."""
    status = JobStatus(state=state, model="m", error="boom" if state == "failed" else None)
    if spaced:
        job.status.write_text(json.dumps(msgspec.to_builtins(status), indent=2))
    else:
        job.write_status(status)


def _head(job: JobDir, exited: AgentExit | None = None) -> None:
    head = msgspec.structs.replace(record("decode-0"), name="prefill-0", role="prefill", index=0)
    head.exited = exited
    write_record(job, head)


def test_an_end_counts_only_once_the_job_was_seen_alive(job: JobDir) -> None:
    """A job directory used again holds the last run's end: not this run's."""
    _status(job, "stopped")
    _head(job, AgentExit(state="stopped", reason="stopped on request", code=0))
    watch = JobEnd(job)
    assert watch.look() is None
    assert watch.looks_ended()
    _head(job)  # the head starts again: its new record has no last word
    assert watch.look() is None
    assert not watch.looks_ended()
    _status(job, "starting", spaced=True)
    assert watch.look() is None
    _status(job, "failed", spaced=True)  # read whole: it does not start with the state
    assert watch.look() == "the job failed (status.json: boom)"


def test_the_heads_last_word_ends_the_job(job: JobDir) -> None:
    _status(job, "ready")
    _head(job)
    watch = JobEnd(job)
    assert watch.look() is None
    job.status.write_bytes(b"{not json")  # unreadable: says nothing either way
    _head(job, AgentExit(state="failed", reason="agent crashed: OSError: x", code=1))
    assert watch.look() == "the head prefill-0 exited (failed: agent crashed: OSError: x)"


async def test_the_watch_returns_once_the_job_stopped(
    job: JobDir, caplog: pytest.LogCaptureFixture
) -> None:
    _status(job, "ready")
    seen = JobEnd(job)
    assert seen.look() is None  # alive, seen before the watch starts: no race with its thread
    ended: list[str] = []

    async def watch() -> None:
        ended.append(await wait_job_end(job, logging.getLogger("t"), "decode-1", seen))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            _status(job, "stopped")
    assert ended == ["the job stopped (status.json)"]
    assert "looks ended" not in caplog.text
