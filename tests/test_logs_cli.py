"""``tilert-submit logs`` on real ``--local --mock`` jobs, as a user runs it (docs/logs.md).

One ready job serves the read-only checks (``--since``, patterns, ``--timestamps``, colours,
``| head -1``); the tests that end a job (``-f`` ending with ``stop`` or a failure, node-local
logs) each start their own. Each test fails when its feature is broken: the expected lines are
computed from the files the agents wrote, not from the command under test.
"""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests import kit
from tests.kit import REPO, clean_env, get
from tests.kit.logs import ENGINES, STAMP, Follower, by_source, file_lines, logs
from tests.kit.metrics import one, samples

READY_S = 40.0
STOP_S = 30.0
# After `tilert-submit stop` returns, how long `logs -f` may take to end (it polls status.json
# twice a second, then waits for the supervisor to be gone).
END_S = 15.0


@pytest.fixture
def followers() -> Iterator[list[Follower]]:
    """Followers a test started; killed afterwards if still running."""
    started: list[Follower] = []
    yield started
    for follower in started:
        follower.kill()


def new_job(tmp_path: Path, *sets: str) -> kit.LocalJob:
    """A local mock job of a test's own (the stand-in router: no router venv needed)."""
    args, _ = kit.isolated_sets(None, *sets)
    return kit.LocalJob(tmp_path / "J", args, env=clean_env())


def chat(job: kit.LocalJob) -> None:
    """One streamed chat: every engine logs lines for it."""
    assert kit.chat(job.status()["router_url"], kit.MODEL) == kit.ANSWER


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kit.LocalJob]:
    """A ready demo job shared by the read-only tests; stopped after the module."""
    with new_job(tmp_path_factory.mktemp("logs-cli")) as job:
        job.wait_state("ready", timeout=READY_S)
        chat(job)
        yield job
        job.stop(STOP_S)


# ---- selection and time ------------------------------------------------------------------------


def test_since_a_duration_and_an_iso_time(running: kit.LocalJob) -> None:
    """``--since 10m`` is everything of a young job; ``--since <ISO>`` only what came after."""
    engine = running.job / "logs" / "decode-0" / "engine.log"
    before = file_lines(engine)
    time.sleep(0.05)
    mark = datetime.now(UTC)
    time.sleep(0.05)
    chat(running)
    # The agent's log pump writes the engine's lines after the client has its answer: wait for
    # the request's last line (its REQSTAT) in the file, so no line of it comes after ``after``.
    after = kit.wait_for(
        "the request's REQSTAT line in decode-0's engine.log",
        lambda: file_lines(engine),
        10,
        until=lambda lines: any("REQSTAT" in line for line in lines[len(before) :]),
    )
    new = after[len(before) :]
    assert new
    recent = logs(running.job, "decode-0", "--since", "10m")
    assert recent.returncode == 0, recent.stderr
    assert by_source(recent.stdout.splitlines())["decode-0"] == after
    iso = mark.isoformat().replace("+00:00", "Z")
    since = logs(running.job, "decode-0", "--since", iso)
    assert since.returncode == 0, since.stderr
    assert by_source(since.stdout.splitlines())["decode-0"] == new
    # The same moment as local time without a zone, and a time to come: nothing.
    local = mark.astimezone().replace(tzinfo=None).isoformat()
    assert logs(running.job, "decode-0", "--since", local).stdout == since.stdout
    assert logs(running.job, "--since", "2999-01-01").stdout == ""
    bad = logs(running.job, "--since", "yesterday")
    assert bad.returncode == 2
    assert "--since 'yesterday'" in bad.stderr


def test_several_names_and_patterns(running: kit.LocalJob) -> None:
    """Several NAMEs and shell patterns select sources, shown in the job's order."""
    done = logs(running.job, "decode-*")
    assert done.returncode == 0, done.stderr
    assert list(by_source(done.stdout.splitlines())) == ["decode-0", "decode-1"]
    done = logs(running.job, "router", "decode-[1]", "prefill-?")
    assert list(by_source(done.stdout.splitlines())) == ["prefill-0", "decode-1", "router"]
    for name, lines in by_source(done.stdout.splitlines()).items():
        path = (
            running.job
            / "logs"
            / ("prefill-0/router.log" if name == "router" else f"{name}/engine.log")
        )
        assert lines == file_lines(path)[: len(lines)], name
    nothing = logs(running.job, "encode-*")
    assert nothing.returncode == 2
    assert "no source matches 'encode-*'" in nothing.stderr
    assert "decode-1" in nothing.stderr
    # The benchmark is a name before it has a folder: said clearly, not an error.
    bench = logs(running.job, "benchmark")
    assert bench.returncode == 0
    assert bench.stdout == ""
    assert "benchmark: no log yet" in bench.stderr
    assert "no benchmark" in bench.stderr


def test_timestamps_are_the_receive_times(running: kit.LocalJob) -> None:
    """``-t``: each line after its prefix gets the ISO time the agent received it."""
    start = (running.job / "plan.json").stat().st_mtime - 1  # written once, at submit
    plain = logs(running.job, "decode-1").stdout.splitlines()
    stamped = logs(running.job, "decode-1", "--timestamps").stdout.splitlines()
    assert len(stamped) >= len(plain) > 3
    times = []
    for line, bare in zip(stamped, plain, strict=False):
        text = line.partition(" | ")[2]
        stamp, _, rest = text.partition(" ")
        assert STAMP.match(stamp), line
        assert rest == bare.partition(" | ")[2]
        times.append(datetime.fromisoformat(stamp).timestamp())
    assert times == sorted(times)
    assert start <= times[0]
    assert times[-1] <= time.time() + 1
    # The agents' own logs: the time their lines start with.
    agent = logs(running.job, "decode-1", "--agent", "-t", "--tail", "1").stdout
    stamp, _, rest = agent.partition(" | ")[2].partition(" ")
    assert rest.startswith(stamp), agent


def test_logs_endpoint_options(running: kit.LocalJob) -> None:
    """/logs: tail=all, since, timestamps, format=json (what tilert-submit reads), 400s, 404."""
    auth = {"Authorization": f"Bearer {running.token()}"}
    base = running.agent("decode-0")["status_url"].removesuffix("/status")
    engine = file_lines(running.job / "logs" / "decode-0" / "engine.log")

    def lines(**params: str) -> list[str]:
        response = get(f"{base}/logs", params=params, headers=auth)
        assert response.status_code == 200, response.text
        return response.text.splitlines()

    assert lines(tail="all") == engine
    stamped = lines(tail="all", timestamps="1")
    assert [x.partition(" ")[2] for x in stamped] == engine
    assert all(STAMP.match(x.partition(" ")[0]) for x in stamped)
    assert lines(tail="all", since=str(time.time() + 60)) == []
    messages = [json.loads(x) for x in lines(tail="2", format="json", timestamps="1")]
    assert [m["line"] for m in messages] == engine[-2:]
    assert all(isinstance(m["time"], float) for m in messages)
    for bad in ({"since": "nan"}, {"since": "soon"}, {"format": "xml"}, {"tail": "some"}):
        assert get(f"{base}/logs", params=bad, headers=auth).status_code == 400, bad
    head = running.agent("prefill-0")["status_url"].removesuffix("/status")
    missing = get(f"{head}/logs", params={"name": "benchmark"}, headers=auth)
    assert missing.status_code == 404
    assert "does not exist yet" in missing.text


# ---- terminals and pipes -----------------------------------------------------------------------


def on_a_terminal(args: list[str], **env: str) -> str:
    """What ``tilert-submit ARGS`` writes when its stdout is a terminal."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [*kit.SUBMIT, *args],
        cwd=REPO,
        env=clean_env(**env),
        stdout=follower,
        stderr=subprocess.DEVNULL,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(30) == 0
    return b"".join(chunks).decode(errors="replace")


def test_colour_on_a_terminal_only(running: kit.LocalJob) -> None:
    """Colours on a terminal; none in a pipe, with --no-color or with NO_COLOR set."""
    args = ["logs", str(running.job), "--tail", "2"]
    assert "\033[" in on_a_terminal(args)
    assert "\033[" not in on_a_terminal([*args, "--no-color"])
    assert "\033[" not in on_a_terminal(args, NO_COLOR="1")
    piped = logs(running.job, "--tail", "2")
    assert piped.returncode == 0
    assert piped.stdout
    assert "\033" not in piped.stdout


@pytest.mark.parametrize("follow", [False, True], ids=["history", "follow"])
def test_head_1_exits_0_quietly(running: kit.LocalJob, follow: bool) -> None:
    """``logs J [-f] | head -1``: one line, and the command ends with 0, saying nothing."""
    proc = subprocess.Popen(
        [*kit.SUBMIT, "logs", str(running.job), *(["-f"] if follow else [])],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    head = subprocess.run(["head", "-1"], stdin=proc.stdout, capture_output=True, timeout=30)
    assert proc.stdout is not None
    proc.stdout.close()
    try:
        code = proc.wait(20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.stderr is not None
    with proc.stderr:
        assert (code, proc.stderr.read()) == (0, b"")
    assert head.stdout.decode().startswith("prefill-0 | ")


# ---- -f ends with the job ----------------------------------------------------------------------


def test_follow_ends_0_after_stop_with_the_restart_line(
    tmp_path: Path, followers: list[Follower]
) -> None:
    """``logs J -f``: an engine SIGKILL shows one restart line; ``stop`` ends it with 0 after
    the engines' last lines."""
    with new_job(tmp_path) as job:
        job.wait_state("ready", timeout=READY_S)
        follower = Follower(job.job)
        followers.append(follower)
        one_name = Follower(job.job, "decode-1")
        followers.append(one_name)
        follower.until(lambda s: {x.partition(" | ")[0].strip() for x in s} >= set(ENGINES), "all")
        pid = kit.agent_status(job.agent("decode-0")["status_url"])["pid"]
        os.kill(pid, signal.SIGKILL)
        restart = (
            f"decode-0  | === decode-0 restart 1: engine pid {pid} killed by signal 9 (SIGKILL)"
        )
        follower.until(lambda s: any(x.startswith(restart) for x in s), "the restart line")
        job.wait_state("ready", timeout=READY_S)
        assert kit.submit_cmd("stop", str(job.job), timeout=60).returncode == 0
        assert follower.wait(END_S) == 0, follower.err()
        assert one_name.wait(END_S) == 0, one_name.err()
    assert len([x for x in follower.lines if x.startswith(restart)]) == 1
    assert len([x for x in follower.lines if " restart " in x]) == 1
    for name in ENGINES:
        assert any(
            x.startswith(f"=== {name} stopped on request") for x in by_source(follower.lines)[name]
        ), name
    assert set(by_source(one_name.lines)) == {"decode-1"}
    assert "Traceback" not in follower.err()


def test_follow_ends_1_when_the_job_fails(tmp_path: Path, followers: list[Follower]) -> None:
    """A prefill crash loop fails the job: ``logs J -f`` shows it and ends with 1."""
    with new_job(tmp_path, *kit.PREFILL_CRASH_LOOP) as job:
        kit.wait_status(job.job, lambda _s: True, "status.json written", 10)
        follower = Follower(job.job)
        followers.append(follower)
        assert follower.wait(READY_S + END_S) == 1, follower.err()
        assert job.status()["state"] == "failed"
    prefill = by_source(follower.lines)["prefill-0"]
    assert any(x.startswith("=== prefill-0 failed: ") for x in prefill), prefill[-5:]


# ---- node-local logs ---------------------------------------------------------------------------


def test_node_local_logs_through_the_agents(tmp_path: Path, followers: list[Follower]) -> None:
    """``agent.logs.location: node``: engine logs only on the node's disk, read (and followed)
    through each agent's /logs with the same output; an agent that is gone is named."""
    nodes = tmp_path / "node-disk"
    with new_job(tmp_path, "agent.logs.location=node", f"agent.logs.node_dir={nodes}") as job:
        job.wait_state("ready", timeout=READY_S)
        chat(job)
        folder = nodes / job.job.name
        files = {name: folder / name / "engine.log" for name in kit.AGENTS}
        files["router"] = folder / "prefill-0" / "router.log"
        status = job.status()
        for entry in status["agents"]:
            assert entry["log"] == str(files[entry["name"]]), entry
        for name in kit.AGENTS:
            assert not (job.job / "logs" / name / "engine.log").exists()
            assert (job.job / "logs" / name / "agent.log").is_file()
        assert oct(folder.stat().st_mode & 0o777) == "0o700"
        # The same lines as the files hold, through the endpoints.
        done = logs(job.job)
        assert done.returncode == 0, done.stderr
        shown = by_source(done.stdout.splitlines())
        assert list(shown) == ENGINES
        for name, path in files.items():
            assert shown[name], name
            assert shown[name] == file_lines(path)[: len(shown[name])], name
        stamped = logs(job.job, "decode-1", "-t", "--tail", "2").stdout.splitlines()
        assert len(stamped) == 2
        assert all(STAMP.match(x.split(" ")[2]) for x in stamped)
        # The sink's counters count the same way (the file is elsewhere, that is all).
        page = samples(get(job.agent("decode-0")["metrics_url"]).text)
        written = one(page, "tilert_agent_log_lines_total", component="engine", outcome="written")
        assert written.value > 0
        follower = Follower(job.job)
        followers.append(follower)
        follower.until(lambda s: {x.partition(" | ")[0].strip() for x in s} >= set(ENGINES), "all")
        count = len(follower.lines)
        chat(job)
        follower.until(lambda s: len(s) > count, "the new request's lines")
        assert kit.submit_cmd("stop", str(job.job), timeout=60).returncode == 0
        assert follower.wait(END_S) == 0, follower.err()
        for name in ENGINES:
            last = by_source(follower.lines)[name]
            assert any(x.startswith(f"=== {name} stopped on request") for x in last), name
        # The job is over: its logs stay on the nodes, and the agents cannot be asked.
        after = logs(job.job)
        assert after.returncode == 1
        for name in kit.AGENTS:
            assert f"{name}: could not reach its agent at http://127.0.0.1:" in after.stderr
        assert "Traceback" not in after.stderr
