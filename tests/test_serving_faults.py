"""A serving job survives bad files, failed writes and dead or frozen peers (docs/reliability.md).

Real local mock jobs (``tilert-submit --local --mock``, the router stand-in) or real agents
(tests/kit) with real faults: files planted in ``J/rendezvous``, a tmpfs mounted on the job
directory and filled or remounted read-only, the job directory removed, agents SIGKILLed and
SIGSTOPped. The non-destructive scenarios share one job; every other fault runs a job of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from agent.head.peers import ANSWER_MARGIN_S, LONG_POLL_S, UNREACHABLE_FAIL_S
from agent.node.jobwrites import RETRY_MAX_S
from agent.node.rendezvous import RECORD_RETRY_S
from submit.statusview import STALE_AFTER_S
from tests import kit
from tests.conftest import require
from tests.kit import FAST, Agents, make_job, running_agents, wait_for

READY_S = 30.0
# The head writes status.json at least this often (agent.node.statuswriter).
HEARTBEAT_S = 5.0
# A decode whose record is bad from the start is dropped within this, a tenth of the 600 s
# startup budget its test sets: not waited for (the job's own starts are in it too).
BAD_RECORD_S = 60.0


# ---- helpers --------------------------------------------------------------------------------


def local_job(path: Path, *sets: str) -> kit.LocalJob:
    """``tilert-submit --local --mock`` with the fast test settings and the router stand-in."""
    args, _ = kit.isolated_sets(None, *FAST, *sets)
    return kit.LocalJob(path, args)


def own_ports(*sets: str) -> tuple[str, ...]:
    """``--set`` values for a job made with ``make_job``: a router port and port bases of its
    own (the defaults are shared with every other job on this machine), then ``sets``."""
    flags, _ = kit.isolated_sets(None, *sets)
    return tuple(flags[1::2])


def wait_dropped(job: Path, name: str, timeout: float, why: str) -> dict[str, Any]:
    """``name`` failed with ``why`` in its reason, dropped, the router healthy through decode-0
    alone."""
    only = [kit.decode_spec(job, "decode-0")]
    return kit.wait_status(
        job,
        lambda s: (
            s["state"] == "degraded"
            and kit.agent_entry(s, name)["state"] == "failed"
            and why in kit.agent_entry(s, name)["reason"]
            and "dropped from the router" in kit.agent_entry(s, name)["reason"]
            and kit.router_decodes(job, s) == only
        ),
        f"degraded with {name} dropped ({why})",
        timeout,
    )


def no_traceback(job: Path) -> None:
    """No agent logged a traceback (agent.log, and its stderr under --local)."""
    for path in [*job.glob("logs/*/agent.log"), *job.glob("logs/*/agent.stderr.log")]:
        text = path.read_text(errors="replace")
        assert "Traceback" not in text, f"{path}:\n{text[-3000:]}"


@pytest.fixture
def agents() -> Iterator[Agents]:
    """Agents of one test, killed (with their engines) afterwards."""
    with running_agents() as started:
        yield started


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kit.LocalJob]:
    """One ready job for the scenarios that leave it serving."""
    with local_job(tmp_path_factory.mktemp("serving") / "job") as job:
        job.wait_state("ready", timeout=READY_S)
        yield job


# ---- files in J/rendezvous ------------------------------------------------------------------


# Files in J/rendezvous that are no agent's record (place_strays writes one of each kind).
STRAYS = ("notes.json", "decode-7.json", "prefill-1.json", "decode-99.json")


def place_strays(strays: list[Path]) -> None:
    """Strays of every kind (``STRAYS``' paths): garbage, a copy of decode-0's record under a
    name no agent has, a symlink and a FIFO."""
    strays[0].write_bytes(b"\x00garbage")
    strays[1].write_bytes(strays[1].with_name("decode-0.json").read_bytes())
    strays[2].symlink_to("/etc/passwd")
    os.mkfifo(strays[3])


def half_written_for_a_moment(job: Path, record: Path, original: bytes) -> None:
    """``record`` half-written (as NFS shows one) for less than the retry, then whole: the job
    stays ready and the record's agent shows no problem."""
    record.write_bytes(original[: len(original) // 2])
    time.sleep(RECORD_RETRY_S / 2)  # the scenario is a window shorter than the retry
    record.write_bytes(original)
    time.sleep(RECORD_RETRY_S)  # and nothing may follow from it: nothing to wait for
    status = kit.current_status(job)
    assert status["state"] == "ready", status
    assert "decode-1.json" not in kit.agent_entry(status, "decode-1")["reason"], status


def replaced_records_keep_serving(job: Path, d1: Path, copy: Path, seen: list[str]) -> None:
    """decode-1's record replaced by a symlink to a good ``copy``, then by decode-0's record:
    decode-1 is named with the problem, keeps its last good record, and the job serves."""

    def still_ready() -> None:
        status = kit.read_status(job)
        assert status is None or status["state"] == "ready", status

    for kind, said in (
        ("symlink", "a symbolic link, not followed"),
        ("decode-0's record", "'decode-0'"),
    ):
        d1.unlink()
        if kind == "symlink":
            d1.symlink_to(copy)
        else:
            d1.write_bytes(d1.with_name("decode-0.json").read_bytes())

        def names(s: dict[str, Any], said: str = said) -> bool:
            return said in kit.agent_entry(s, "decode-1")["reason"]

        status = kit.wait_status(
            job,
            names,
            f"decode-1's reason naming {said!r}",
            RECORD_RETRY_S + 5,
            seen=seen,
            each=still_ready,
        )
        row = kit.agent_entry(status, "decode-1")
        assert row["state"] == "healthy"
        assert "its last good record is used" in row["reason"]
        assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER


def test_bad_files_beside_and_over_records_leave_the_job_serving(
    serving: kit.LocalJob, tmp_path: Path
) -> None:
    """Strays (garbage, a FIFO, a symlink, a copy under a name no agent has) are ignored and logged
    once; a record half-written for a moment changes nothing; one replaced by a symlink or by
    another agent's record is a problem of that agent only: the job stays ready and serves."""
    job = serving.job
    folder = job / "rendezvous"
    d1 = folder / "decode-1.json"
    original = d1.read_bytes()
    seen: list[str] = []
    strays = [folder / name for name in STRAYS]

    def restore() -> None:
        d1.unlink(missing_ok=True)
        d1.write_bytes(original)

    try:
        place_strays(strays)
        half_written_for_a_moment(job, d1, original)
        copy = tmp_path / "decode-1.json"
        copy.write_bytes(original)
        replaced_records_keep_serving(job, d1, copy, seen)
        restore()
        kit.wait_status(
            job,
            lambda s: "decode-1.json" not in kit.agent_entry(s, "decode-1")["reason"],
            "decode-1's record readable again",
            5,
            seen=seen,
        )
        assert seen == ["ready"], seen
        log = (job / "logs/prefill-0/agent.log").read_text()
        for stray in strays:
            assert log.count(f"head: ignoring {stray.name} in") == 1, log[-3000:]
        assert "decode-1's rendezvous record is readable again" in log
        no_traceback(job)
    finally:
        # A FIFO left behind would block anyone who opens it (the kit's teardown reads records).
        for path in strays:
            path.unlink(missing_ok=True)
        if d1.is_symlink() or d1.read_bytes() != original:
            restore()


@pytest.mark.parametrize("kind", ["half-written", "symlink", "another agent's"])
def test_a_decode_record_bad_from_the_start_fails_that_decode_only(
    tmp_path: Path, agents: Agents, kind: str
) -> None:
    """decode-1 never publishes a good record: after the retry it is failed (reason naming the
    file), not waited for, dropped, and the job serves through decode-0, far within its budget
    (600 s here: the bound below is a tenth of it, with room for a loaded machine's starts)."""
    job = make_job(
        tmp_path, *own_ports("agent.startup_budget_s={prefill: 600, decode: 600, router: 60}")
    )
    folder = job / "rendezvous"
    head = agents.start(job, "prefill", 0)
    d0 = agents.start(job, "decode", 0)
    good = json.dumps(d0.wait_record()).encode()
    bad = folder / "decode-1.json"
    if kind == "half-written":
        bad.write_bytes(good[:40])
        said = "cut short"
    elif kind == "symlink":
        target = tmp_path / "decode-1.json"
        target.write_bytes(good.replace(b"decode-0", b"decode-1"))
        bad.symlink_to(target)
        said = "symbolic link"
    else:
        bad.write_bytes(good)
        said = "the record of 'decode-0', not of decode-1"
    status = wait_dropped(job, "decode-1", BAD_RECORD_S, said)
    assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER
    assert head.popen.poll() is None
    no_traceback(job)


# ---- dead, frozen and crashed peers ---------------------------------------------------------


def test_a_killed_decode_agent_is_dropped_within_seconds(tmp_path: Path) -> None:
    """SIGKILL to decode-1's agent (its engine dies with it): failed after the unreachable bound,
    dropped, the router restarted without it; the job serves degraded through decode-0."""
    with local_job(tmp_path / "job") as job:
        job.wait_state("ready", timeout=READY_S)
        kit.agent_process(job.job, "decode-1").kill()
        killed = time.monotonic()
        status = wait_dropped(job.job, "decode-1", UNREACHABLE_FAIL_S + 15, "not answering")
        assert time.monotonic() - killed < UNREACHABLE_FAIL_S + 10
        assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER
        assert (
            "decode-1 dropped" in kit.head_status(status)["reason"] or status["state"] == "degraded"
        )
        no_traceback(job.job)


def test_a_frozen_decode_agent_is_failed_after_the_bound_and_rejoins_thawed(
    tmp_path: Path,
) -> None:
    """SIGSTOP to decode-1's agent: it answers nothing; within the long poll, its margin and the
    unreachable bound it is failed and dropped; thawed, it answers healthy again and is taken
    back (the router restarted with it, proven again): ``ready`` with both decodes."""
    with local_job(tmp_path / "job") as job:
        job.wait_state("ready", timeout=READY_S)
        agent = kit.agent_process(job.job, "decode-1")
        agent.suspend()
        try:
            bound = LONG_POLL_S + ANSWER_MARGIN_S + UNREACHABLE_FAIL_S
            status = wait_dropped(job.job, "decode-1", bound + 15, "not answering")
            assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER
        finally:
            agent.resume()
        both = [kit.decode_spec(job.job, "decode-0"), kit.decode_spec(job.job, "decode-1")]
        status = kit.wait_status(
            job.job,
            lambda s: s["state"] == "ready" and kit.router_decodes(job.job, s) == both,
            "ready again with decode-1 back in the router",
            READY_S,
        )
        d1 = kit.agent_entry(status, "decode-1")
        assert (d1["state"], d1["rejoins"]) == ("healthy", 1), d1
        assert "not answering" in d1["rejoin_reason"], d1


def test_a_decode_agents_last_word_fails_it_at_once(tmp_path: Path, agents: Agents) -> None:
    """A decode agent that exits on an error leaves its record with ``exited``: the head takes it
    as failed at once (no unreachable bound, no startup budget) and serves without it."""
    job = make_job(
        tmp_path, *own_ports("agent.startup_budget_s={prefill: 600, decode: 600, router: 60}")
    )
    agents.start(job, "prefill", 0)
    d0 = agents.start(job, "decode", 0)
    record = d0.wait_record()
    record.update(
        name="decode-1",
        index=1,
        ports={},
        status_url="",
        metrics_url="",
        exited={"state": "failed", "reason": "agent crashed: OSError: boom", "code": 1, "at": 0},
    )
    (job / "rendezvous" / "decode-1.json").write_text(json.dumps(record))
    status = wait_dropped(job, "decode-1", READY_S, "its agent exited with code 1: agent crashed")
    assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER
    targets = json.loads((job / "prometheus" / "targets.json").read_text())
    assert sorted(t["labels"]["agent"] for t in targets) == ["decode-0", "prefill-0"]


def test_a_frozen_head_leaves_the_job_serving(serving: kit.LocalJob) -> None:
    """SIGSTOP to the head agent: the router and every engine go on serving; status.json goes
    stale (``tilert-submit status`` says so); thawed, the head catches up and nothing was lost."""
    job = serving.job
    status = kit.wait_state(job, "ready", 10)
    head = kit.agent_process(job, "prefill-0")
    head.suspend()
    try:
        assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER
        kit.wait_for(
            "tilert-submit status calling status.json stale",
            lambda: json.loads(kit.submit_cmd("status", str(job), "--json").stdout)["stale"],
            STALE_AFTER_S + HEARTBEAT_S + 10,
            interval=1.0,
        )
        assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER
    finally:
        head.resume()
    # Thawed, its long polls and probes that timed out meanwhile are asked again: a moment of
    # ``degraded`` is allowed, a dropped or failed peer is not.
    seen: list[str] = []
    fresh = kit.wait_status(
        job,
        lambda s: time.time() - s["updated_at"] < 2 and s["state"] == "ready",
        "fresh and ready again",
        HEARTBEAT_S + 10,
        seen=seen,
    )
    assert set(seen) <= {"ready", "degraded"}, seen
    assert all(a["state"] == "healthy" for a in fresh["agents"]), fresh
    assert not any("dropped" in a["reason"] for a in fresh["agents"]), fresh
    assert kit.chat(fresh["router_url"], kit.MODEL) == kit.ANSWER


def test_a_killed_router_is_restarted_on_its_port(serving: kit.LocalJob) -> None:
    """SIGKILL to the router: the head's supervisor starts it again on the same port (clients
    rely on it); the job is ``degraded`` meanwhile, then ``ready``, and serves."""
    job = serving.job
    status = kit.wait_state(job, "ready", 10)
    before = kit.head_status(status)["router"]
    seen: list[str] = []
    psutil.Process(before["pid"]).kill()
    kit.wait_status(
        job,
        lambda s: (
            s["state"] == "ready"
            and (router := kit.head_status(s)["router"])["state"] == "healthy"
            and router["pid"] not in (None, before["pid"])
        ),
        "ready with a new router",
        30,
        seen=seen,
    )
    after = kit.head_status(status)["router"]
    assert after["ports"] == before["ports"]
    assert after["restarts"] == before["restarts"] + 1
    assert "degraded" in seen, seen
    assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER


def test_a_late_decode_is_waited_for(tmp_path: Path, agents: Agents) -> None:
    """A decode whose record comes late (its node started late) is waited for within the
    startup budget: the job is ``starting`` meanwhile, then ``ready`` with every decode."""
    job = make_job(tmp_path, *own_ports())
    agents.start(job, "prefill", 0)
    agents.start(job, "decode", 0)
    status = kit.wait_status(
        job,
        lambda s: kit.agent_entry(s, "decode-0")["state"] == "healthy",
        "decode-0 healthy",
        READY_S,
    )
    assert status["state"] == "starting", status
    assert kit.agent_entry(status, "decode-1")["reason"] == "no rendezvous record yet"
    time.sleep(2)  # a while without it: still waited for (nothing to wait for)
    assert kit.current_status(job)["state"] == "starting"
    agents.start(job, "decode", 1)
    status = kit.wait_state(job, "ready", READY_S)
    assert all(a["state"] == "healthy" for a in status["agents"]), status
    assert sorted(kit.router_decodes(job, status) or []) == sorted(
        kit.decode_spec(job, name) for name in ("decode-0", "decode-1")
    )


def test_a_killed_head_is_reported_as_killed(tmp_path: Path) -> None:
    """SIGKILL to the head under --local: tilert-submit says how it died (not some agent's last
    log line), status.json is failed with the head's row failed too, and nothing is left."""
    with local_job(tmp_path / "job") as job:
        job.wait_state("ready", timeout=READY_S)
        kit.agent_process(job.job, "prefill-0").kill()
        assert job.wait_exit(30) == 1, job.output()
        status = job.status()
        why = "the head agent prefill-0 was killed by SIGKILL before it could say why"
        assert status["state"] == "failed", status
        assert status["error"].startswith(why), status
        assert status["router_url"] is None
        row = kit.agent_entry(status, "prefill-0")
        assert row["state"] == "failed", row
        assert row["reason"] == status["error"], row
        assert status["router"]["state"] == "failed", status["router"]
        assert "the head agent prefill-0 was killed by SIGKILL" in job.output()
        kit.assert_nothing_left(job.job, 10)


# ---- the job directory cannot be written -------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An empty directory with a 32 MiB tmpfs mounted on it (unmounted afterwards)."""
    require(os.geteuid() == 0, "mounting a tmpfs needs root (CI runs as root: .ci/run)")
    where = tmp_path / "job"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(where: Path) -> Path:
    """Fill the file system of ``where`` to the last byte; the file that does it."""
    filler = where / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


def check_serving_without_writes(
    job: kit.LocalJob, broken: str, break_it: Callable[[], None], repair: Callable[[], None]
) -> None:
    """Break the job directory: the head's /status names the failed write (``broken``), every
    engine keeps serving, an engine SIGKILLed meanwhile comes back; repaired, status.json is
    written again with the state of now and the problem is gone."""
    status = job.wait_state("ready", timeout=READY_S)
    head_url = kit.agent_entry(status, "prefill-0")["status_url"]
    router = status["router_url"]
    break_it()
    problems = wait_for(
        "the head's /status naming the failed write",
        lambda: [p for p in kit.agent_status(head_url).get("problems", []) if broken in p],
        HEARTBEAT_S + 5,
    )
    assert "status.json" in problems[0], problems
    assert kit.chat(router, kit.MODEL) == kit.ANSWER
    decode0 = kit.agent_entry(status, "decode-0")["status_url"]
    d0 = kit.agent_status(decode0)
    psutil.Process(d0["pid"]).kill()
    wait_for(
        "decode-0 restarted and healthy",
        lambda: (s := kit.agent_status(decode0))["state"] == "healthy" and s["pid"] != d0["pid"],
        20,
    )
    assert kit.chat(router, kit.MODEL) == kit.ANSWER
    assert job.proc.poll() is None, job.output()
    repair()
    wait_for(
        "the head's problems cleared",
        lambda: "problems" not in kit.agent_status(head_url),
        RETRY_MAX_S + 5,
    )
    fresh = kit.wait_status(
        job.job,
        lambda s: time.time() - s["updated_at"] < HEARTBEAT_S + 1 and s["state"] == "ready",
        "status.json fresh and ready",
        HEARTBEAT_S + 5,
    )
    assert kit.agent_entry(fresh, "decode-0")["restarts"] == 1, fresh
    no_traceback(job.job)


def test_a_full_job_directory_keeps_the_job_serving(tmpfs: Path) -> None:
    """The job directory's file system full: the agents keep serving and say so, then catch up."""
    with local_job(tmpfs) as job:
        filler: list[Path] = []
        check_serving_without_writes(
            job,
            "No space left on device",
            lambda: filler.append(fill(tmpfs)),
            lambda: filler[0].unlink(),
        )
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait_exit(30) == 0, job.output()


def test_a_read_only_job_directory_keeps_the_job_serving(tmp_path: Path) -> None:
    """The job directory made read-only (a read-only bind mount over it: files already open stay
    writable, as after an NFS export turns read-only): the same, and a stop afterwards is clean."""
    require(os.geteuid() == 0, "a bind mount needs root (CI runs as root: .ci/run)")
    where = tmp_path / "job"

    def read_only() -> None:
        subprocess.run(["mount", "--bind", str(where), str(where)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], check=True)

    def writable() -> None:
        subprocess.run(["umount", "-l", str(where)], check=True)

    with local_job(where) as job:
        try:
            check_serving_without_writes(job, "Read-only file system", read_only, writable)
        finally:
            subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait_exit(30) == 0, job.output()
        kit.assert_nothing_left(job.job, 10)


def test_a_removed_job_directory_keeps_the_job_serving_until_stopped(tmp_path: Path) -> None:
    """The job directory removed while serving: the engines keep serving, the head says it cannot
    write status.json, and a stop still ends everything (exit 0)."""
    with local_job(tmp_path / "job") as job:
        status = job.wait_state("ready", timeout=READY_S)
        head_url = kit.agent_entry(status, "prefill-0")["status_url"]
        _, procs = kit.running_processes(job.job, at_least=7)
        shutil.rmtree(job.job)
        wait_for(
            "the head's /status naming the failed write",
            lambda: any(
                "No such file or directory" in p
                for p in kit.agent_status(head_url).get("problems", [])
            ),
            HEARTBEAT_S + 5,
        )
        assert kit.chat(status["router_url"], kit.MODEL) == kit.ANSWER
        assert httpx.get(head_url, timeout=5).json()["state"] == "healthy"
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait_exit(30) == 0, job.output()
        kit.assert_gone(procs, 5)
        assert "Traceback" not in job.output()
