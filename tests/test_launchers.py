"""The process launcher with real processes, and the pyxis launcher's command line."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest
import trio
import trio.testing

from agent.launch import (
    LaunchSpec,
    LocalProcess,
    ProcessLauncher,
    PyxisLauncher,
    RunTimeout,
    child,
    make_launcher,
)
from agent.launch.pyxis import (
    ENGINE_ID_ENV,
    find_marked_leader,
    pyxis_container_name,
    pyxis_srun_argv,
)
from tests.conftest import require
from tests.kit import alive, wait_gone

PY = sys.executable
BASE_ENV = {"PATH": os.environ.get("PATH", os.defpath)}
REPO = Path(__file__).resolve().parent.parent


def kill_pids(pids: list[int]) -> None:
    """Teardown: SIGKILL whatever of ``pids`` is left."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def spec(argv: list[str], env: dict[str, str] | None = None, **kw: object) -> LaunchSpec:
    """A spec with a minimal environment."""
    return LaunchSpec(name="test", argv=argv, env=env or dict(BASE_ENV), **kw)  # type: ignore[arg-type]


async def read_all(engine: LocalProcess) -> bytes:
    """The engine's output up to EOF."""
    data = b""
    while chunk := await engine.output.receive_some(65536):
        data += chunk
    return data


async def read_line(engine: LocalProcess) -> bytes:
    """One line of output (the first)."""
    data = b""
    while b"\n" not in data:
        chunk = await engine.output.receive_some(1)
        assert chunk, f"EOF before a line; got {data!r}"
        data += chunk
    return data.strip()


@pytest.fixture
async def launcher() -> AsyncIterator[ProcessLauncher]:
    """A ProcessLauncher whose engines are all killed after the test."""
    engines: list[LocalProcess] = []
    real = ProcessLauncher()

    class Tracking(ProcessLauncher):
        async def start(self, spec: LaunchSpec) -> LocalProcess:
            engine = await real.start(spec)
            engines.append(engine)
            return engine

    yield Tracking()
    for engine in engines:
        engine.kill()
        with trio.move_on_after(5):
            await engine.wait()


# ---- start, wait, exit status, output --------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "status"),
    [("exit 0", 0), ("exit 3", 3), ("kill -TERM $$", -signal.SIGTERM), ("kill -KILL $$", -9)],
)
async def test_exit_status(launcher: ProcessLauncher, script: str, status: int) -> None:
    engine = await launcher.start(spec(["sh", "-c", script]))
    assert await engine.wait() == status
    assert engine.returncode == status
    assert await engine.wait() == status  # again: the same answer


async def test_own_process_group_and_devnull_stdin(launcher: ProcessLauncher) -> None:
    engine = await launcher.start(spec(["sh", "-c", "cat; echo $$ $(ps -o pgid= -p $$)"]))
    out = (await read_all(engine)).split()
    assert await engine.wait() == 0
    # cat read EOF at once (stdin is /dev/null); the leader is its own group's leader.
    assert [int(x) for x in out] == [engine.pid, engine.pid]
    assert engine.pid != os.getpgid(0)


async def test_output_carries_stdout_and_stderr_then_eof(launcher: ProcessLauncher) -> None:
    engine = await launcher.start(spec(["sh", "-c", "echo one; echo two >&2; echo three"]))
    with trio.fail_after(10):
        out = await read_all(engine)
    assert out == b"one\ntwo\nthree\n"
    assert await engine.wait() == 0


async def test_environment_is_exactly_the_given_one(launcher: ProcessLauncher) -> None:
    env = {"PATH": BASE_ENV["PATH"], "ONLY_THIS": "value with spaces", "EMPTY": ""}
    engine = await launcher.start(spec(["env"], env=env))
    out = (await read_all(engine)).decode()
    assert await engine.wait() == 0
    assert sorted(out.splitlines()) == sorted(f"{k}={v}" for k, v in env.items())


async def test_cwd(launcher: ProcessLauncher, tmp_path: Path) -> None:
    engine = await launcher.start(spec(["pwd"], cwd=tmp_path))
    assert (await read_all(engine)).decode().strip() == str(tmp_path)


async def test_environment_keeps_a_given_pwd(launcher: ProcessLauncher, tmp_path: Path) -> None:
    # The shell in the start chain sets PWD to the working directory; the program gets the given.
    env = {"PATH": BASE_ENV["PATH"], "PWD": "/as/given", "SHLVL": "7"}
    engine = await launcher.start(spec(["env"], env=env, cwd=tmp_path))
    out = (await read_all(engine)).decode()
    assert sorted(out.splitlines()) == sorted(f"{k}={v}" for k, v in env.items())


async def test_missing_program_is_oserror(launcher: ProcessLauncher, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await launcher.start(spec(["/nonexistent/engine"]))
    with pytest.raises(FileNotFoundError):
        await launcher.start(spec(["no-such-engine-on-path"]))
    (tmp_path / "engine").write_text("#!/bin/sh\n")  # not executable
    with pytest.raises(PermissionError):
        await launcher.start(spec([str(tmp_path / "engine")]))
    with pytest.raises(PermissionError):
        await launcher.start(spec(["./engine"], cwd=tmp_path))


async def test_without_setpriv_the_lifeline_alone_guards(
    launcher: ProcessLauncher, monkeypatch: pytest.MonkeyPatch
) -> None:
    # util-linux before 2.33 (RHEL 8) has no setpriv --pdeathsig: the program starts unwrapped.
    monkeypatch.setattr(child, "_wrapper_tools", lambda: None)
    engine = await launcher.start(spec(["sh", "-c", "echo $PPID"]))
    assert int(await read_line(engine)) == os.getpid()
    assert await engine.wait() == 0


def test_no_python_runs_in_the_child() -> None:
    """bringup-hang.md: with a preexec_fn a child that stalled before exec held the trio thread
    (deaf to signals) for as long as it stalled; an after-fork hook stands in for the stall."""
    code = textwrap.dedent(
        """
        import os, time, trio
        os.register_at_fork(after_in_child=lambda: time.sleep(20))
        from agent.launch import LaunchSpec, ProcessLauncher

        async def main():
            t0 = time.monotonic()
            engine = await ProcessLauncher().start(
                LaunchSpec(name="t", argv=["true"], env={"PATH": os.environ["PATH"]})
            )
            print(time.monotonic() - t0, flush=True)
            await engine.wait()

        trio.run(main)
        """
    )
    done = subprocess.run(
        [PY, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # Python in the child would take the 20 s stall; a start without it takes milliseconds, and
    # the bound leaves a loaded machine room (it was 1 s against a 5 s stall).
    assert float(done.stdout) < 5.0, done.stdout


def test_a_child_whose_parent_is_not_the_agent_never_runs() -> None:
    # The agent died before the prctl (so no PDEATHSIG will ever fire): the chain stops before the
    # program. Here the chain's parent is a shell in between, not this (the expected) process.
    prefix = child.die_with_parent_prefix(dict(BASE_ENV))
    require(bool(prefix), "setpriv --pdeathsig is not available here (util-linux 2.33 or later)")
    done = subprocess.run(
        ["/bin/sh", "-c", '"$@"; echo "exit $?"', "sh", *prefix, "sh", "-c", "echo ran"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert done.stdout == "exit 1\n", done


async def test_setup_script_is_sourced_and_pid_kept(
    launcher: ProcessLauncher, tmp_path: Path
) -> None:
    script = tmp_path / "setup.sh"
    # It sees and clobbers "$@" and common names; the engine's argv must survive intact.
    script.write_text('export FROM_SETUP="set up"\nset -- clobbered\nargs=x\ns=y\n')
    engine = await launcher.start(
        spec(
            ["sh", "-c", 'echo "$$|$FROM_SETUP|$1|$2"', "sh", "a b", "--flag"],
            setup_script=script,
        )
    )
    out = (await read_all(engine)).decode().strip()
    assert await engine.wait() == 0
    assert out == f"{engine.pid}|set up|a b|--flag"


async def test_failing_setup_script_never_starts_the_engine(
    launcher: ProcessLauncher, tmp_path: Path
) -> None:
    script = tmp_path / "setup.sh"
    script.write_text("echo setting up; return 4\n")
    engine = await launcher.start(spec(["sh", "-c", "echo engine ran"], setup_script=script))
    out = await read_all(engine)
    assert await engine.wait() == 4
    assert out == b"setting up\n"


# ---- stopping ----------------------------------------------------------------------------------

# A leader that ignores SIGTERM, with a grandchild (its own child) that ignores it too.
STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, lambda *a: print("leader got TERM", flush=True))
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print(child.pid, flush=True)
    while True:
        time.sleep(0.05)
    """
)


async def test_stop_terms_then_kills_the_whole_group(launcher: ProcessLauncher) -> None:
    engine = await launcher.start(spec([PY, "-c", STUBBORN]))
    grandchild = int(await read_line(engine))
    try:
        pids = {p.pid for p in engine.descendants()}
        assert {engine.pid, grandchild} <= pids
        t0 = time.monotonic()
        status = await engine.stop(grace_s=0.5)
        elapsed = time.monotonic() - t0
        assert status == -signal.SIGKILL
        assert elapsed >= 0.5  # the grace was given before SIGKILL
        assert b"leader got TERM" in await read_all(engine)
        assert wait_gone([engine.pid, grandchild], 1.0) == []
        assert engine.descendants() == []
        assert await engine.stop(grace_s=5) == status  # idempotent
    finally:
        kill_pids([grandchild])


async def test_stop_graceful_exit_within_grace(launcher: ProcessLauncher) -> None:
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        "print('up', flush=True)\ntime.sleep(600)"
    )
    engine = await launcher.start(spec([PY, "-c", code]))
    assert await read_line(engine) == b"up"
    with trio.fail_after(20):
        assert await engine.stop(grace_s=15) == 0


async def test_stop_while_another_task_waits(launcher: ProcessLauncher) -> None:
    engine = await launcher.start(spec(["sleep", "600"]))
    results: list[int] = []
    async with trio.open_nursery() as nursery:

        async def waiter() -> None:
            results.append(await engine.wait())

        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()  # the waiter is in engine.wait()
        results.append(await engine.stop(grace_s=5))
    assert results == [-signal.SIGTERM, -signal.SIGTERM]


async def test_kill_is_immediate_for_the_group(launcher: ProcessLauncher) -> None:
    engine = await launcher.start(spec([PY, "-c", STUBBORN]))
    grandchild = int(await read_line(engine))
    try:
        engine.kill()
        with trio.fail_after(5):
            assert await engine.wait() == -signal.SIGKILL
        assert wait_gone([grandchild], 1.0) == []
    finally:
        kill_pids([grandchild])


async def test_leftovers_die_when_the_leader_exits(launcher: ProcessLauncher) -> None:
    # The leader exits on its own and leaves a grandchild behind (it would hold ports or GPUs).
    engine = await launcher.start(spec(["sh", "-c", "sleep 600 & echo $!; exit 5"]))
    grandchild = int(await read_line(engine))
    try:
        assert await engine.wait() == 5
        assert wait_gone([grandchild], 1.0) == []
        with trio.fail_after(5):
            await read_all(engine)  # and the pipe reaches EOF
    finally:
        kill_pids([grandchild])


async def test_run_collects_output_and_status(launcher: ProcessLauncher) -> None:
    code, out = await launcher.run(spec(["sh", "-c", "echo a; echo b >&2; exit 2"]), timeout_s=10)
    assert (code, out) == (2, b"a\nb\n")


async def test_run_times_out_and_kills(launcher: ProcessLauncher, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    with pytest.raises(RunTimeout) as caught:
        await launcher.run(
            spec(["sh", "-c", f"echo $$ > {pidfile}; echo started; exec sleep 600"]),
            timeout_s=0.5,
        )
    assert caught.value.output == b"started\n"
    assert wait_gone([int(pidfile.read_text())], 1.0) == []


def test_refuses_to_fork_from_another_thread() -> None:
    errors: list[BaseException] = []

    def in_thread() -> None:
        try:
            trio.run(ProcessLauncher().start, spec(["true"]))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert isinstance(errors[0], RuntimeError)
    assert "main" in str(errors[0])


# ---- the agent dies: no engine outlives it ----------------------------------------------------

AGENT = textwrap.dedent(
    """
    import os, sys, trio
    from agent.launch import LaunchSpec, ProcessLauncher

    async def main():
        engine = await ProcessLauncher().start(LaunchSpec(
            name="engine",
            argv=["sh", "-c", "sleep 600 & echo $!; wait"],
            env={"PATH": os.environ["PATH"]},
        ))
        line = await engine.output.receive_some(100)
        print(engine.pid, int(line), flush=True)
        # Keep trio's worker threads busy and let them retire: the PDEATHSIG trap.
        await trio.to_thread.run_sync(lambda: None)
        await trio.sleep(600)

    trio.run(main)
    """
)


@pytest.fixture
def agent_process() -> Iterator[list[int]]:
    """Pids to clean up after an agent-kill test (the agent, the engine, its grandchild)."""
    pids: list[int] = []
    yield pids
    kill_pids(pids)


def start_agent(pids: list[int]) -> tuple[subprocess.Popen[bytes], int, int]:
    """Run the tiny trio agent; return it, its engine pid, and the engine's child pid."""
    agent = subprocess.Popen(
        [PY, "-c", AGENT],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    pids.append(agent.pid)
    assert agent.stdout is not None
    with agent.stdout:  # its one line read, the pipe is closed (it prints nothing more)
        line = agent.stdout.readline().split()
    assert len(line) == 2, f"agent said {line!r}"
    engine, grandchild = int(line[0]), int(line[1])
    pids += [engine, grandchild]
    return agent, engine, grandchild


def test_sigkill_of_the_agent_leaves_no_engine(agent_process: list[int]) -> None:
    agent, engine, grandchild = start_agent(agent_process)
    assert alive(engine)
    assert alive(grandchild)
    agent.kill()
    agent.wait()
    assert wait_gone([engine, grandchild], 1.0) == []


def test_pdeathsig_kills_the_engine_when_its_lifeline_is_gone(agent_process: list[int]) -> None:
    agent, engine, grandchild = start_agent(agent_process)
    watchers = [p for p in psutil.Process(agent.pid).children() if "tilert-lifeline" in p.cmdline()]
    assert len(watchers) == 1
    watchers[0].kill()
    assert wait_gone([watchers[0].pid], 5.0) == []  # a zombie of the agent's: not alive
    agent.kill()
    agent.wait()
    # The leader dies by its PDEATHSIG; its grandchild had only the lifeline.
    assert wait_gone([engine], 1.0) == []
    assert alive(grandchild)


def test_sigkill_of_the_agent_after_ten_seconds(agent_process: list[int]) -> None:
    # trio's worker threads retire after 10 s idle: an engine forked from one would have been
    # SIGKILLed by its PDEATHSIG by now, while the agent is alive.
    agent, engine, grandchild = start_agent(agent_process)
    time.sleep(10.8)
    assert agent.poll() is None
    assert alive(engine), "the engine died while the agent lived"
    assert alive(grandchild), "the engine died while the agent lived"
    agent.kill()
    agent.wait()
    assert wait_gone([engine, grandchild], 1.0) == []


# ---- finding a pyxis engine by its marker ------------------------------------------------------


async def test_find_marked_leader(launcher: ProcessLauncher) -> None:
    marker = "m-" + os.urandom(6).hex()
    env = {**BASE_ENV, ENGINE_ID_ENV: marker}
    since = time.time()
    # A stand-in for the srun client, which carries the marker too but is excluded by pid.
    client = await launcher.start(spec(["sleep", "600"], env=env))
    engine = await launcher.start(spec(["sh", "-c", "sleep 600 & echo $!; wait"], env=env))
    child = int(await read_line(engine))
    found = find_marked_leader(marker, exclude={client.pid}, since=since)
    assert found == engine.pid != child
    assert find_marked_leader("other", exclude=set(), since=since) is None


# ---- the pyxis command line --------------------------------------------------------------------


def test_pyxis_argv_with_container() -> None:
    s = LaunchSpec(
        name="decode-0",
        argv=["python3", "-m", "tilert.pd_vllm.decode_server", "--http-port", "6100"],
        env={"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1", ENGINE_ID_ENV: "abc"},
        cwd=Path("/work"),
        image="/images/tilert.sqsh",
        mounts=("/models:/models:ro", "/configs:/configs"),
        container_env=("CUDA_VISIBLE_DEVICES", "NOT_IN_ENV"),
    )
    argv = pyxis_srun_argv(s, "1234", "node7", pyxis_container_name(s), step_name="tilert-x")
    assert argv == [
        "srun",
        "--jobid=1234",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=node7",
        "--job-name=tilert-x",
        "--export=ALL",
        "--container-image=/images/tilert.sqsh",
        "--container-name=tilert-decode-0",
        "--no-container-mount-home",
        "--no-container-entrypoint",
        "--container-mounts=/models:/models:ro,/configs:/configs",
        "--container-workdir=/work",
        f"--container-env=CUDA_VISIBLE_DEVICES,{ENGINE_ID_ENV}",
        "python3",
        "-m",
        "tilert.pd_vllm.decode_server",
        "--http-port",
        "6100",
    ]


def test_pyxis_argv_without_container_and_with_setup_script() -> None:
    s = LaunchSpec(
        name="router",
        argv=["python", "-m", "x"],
        env={},
        cwd=Path("/w"),
        mounts=("/a:/a",),
        setup_script=Path("/configs/setup.sh"),
    )
    argv = pyxis_srun_argv(s, "9", "n1", "ignored")
    assert not [a for a in argv if a.startswith(("--container", "--no-container"))]
    assert "--chdir=/w" in argv
    assert "--job-name=tilert-router" in argv
    tail = argv[argv.index("--export=ALL") + 2 :]
    assert argv[argv.index("--export=ALL") + 1] == "--chdir=/w"
    assert tail[0:2] == ["bash", "-c"]
    assert tail[3:] == ["tilert-setup", "/configs/setup.sh", "python", "-m", "x"]


def test_preflight_shares_its_engines_container() -> None:
    engine = LaunchSpec(name="decode-1", argv=[], env={})
    pre = LaunchSpec(name="decode-1-preflight", argv=[], env={})
    assert pyxis_container_name(engine) == pyxis_container_name(pre) == "tilert-decode-1"


def test_make_launcher() -> None:
    assert make_launcher("process", slurm_job_id=None, node=None).name == "process"
    pyxis = make_launcher("pyxis", slurm_job_id="12", node="node1")
    assert isinstance(pyxis, PyxisLauncher)
    assert (pyxis.job_id, pyxis.node) == ("12", "node1")
    with pytest.raises(ValueError, match="SLURM_JOB_ID"):
        make_launcher("pyxis", slurm_job_id=None, node="node1")
