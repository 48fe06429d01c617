"""Rendezvous records: atomic rewrites, temp files skipped, foreign schemas reported by file."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from agent.job.paths import JobDir
from agent.job.records import RendezvousRecord
from agent.node.rendezvous import read_records, write_record


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
    got = read_records(job)
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
    assert read_records(job).by_name["decode-0"].ports["http"] == 6105
    assert sorted(os.listdir(job.rendezvous)) == ["decode-0.json"]
    assert (
        msgspec.json.decode(path.read_bytes())["updated_at"]
        >= msgspec.json.decode(first)["updated_at"]
    )


def test_temp_files_are_ignored(job: JobDir) -> None:
    write_record(job, record())
    (job.rendezvous / ".decode-1.json.abc123.tmp").write_text('{"schema": 1, "na')
    (job.rendezvous / "notes.txt").write_text("hello")
    got = read_records(job)
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
    got = read_records(job)
    assert list(got.by_name) == ["decode-0"]
    assert str(foreign) in got.problems["decode-1"]
    assert "99" in got.problems["decode-1"]
    assert str(broken) in got.problems["decode-2"]


def test_missing_folder_is_empty(tmp_path: Path) -> None:
    got = read_records(JobDir(tmp_path / "nothing"))
    assert got.by_name == {}
    assert got.problems == {}
