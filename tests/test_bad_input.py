"""Bad input gets one clear error, bounded everywhere: files, YAML, numbers, text, paths, job files.

Each case is something a careless user or a damaged machine produces: /dev/zero or a FIFO as the
recipe, an alias bomb, deep nesting, a binary file, a 300-character path component, NaN and
negative settings, a NUL in an argument, a garbage status.json or plan.json, a closed pipe.
The answer is always a message naming the file and key, exit 2 (exit 0 for a closed pipe), and
never a traceback.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from agent.job.paths import JobDir
from agent.job.records import JobStatus
from agent.problems import InputError, error, printable, render_problems
from agent.recipe.cluster import ClusterConfig, load_cluster, read_cluster
from agent.recipe.loader import load_recipe, load_recipe_text, resolved_yaml
from agent.recipe.model import Recipe
from agent.recipe.planner import make_plan
from agent.recipe.textfile import MAX_FILE_BYTES
from agent.recipe.typedyaml import MAX_DEPTH, MAX_NODES
from submit.cli import main
from tests.golden import RECIPES
from tests.kit import AGENT, clean_env

DEMO = RECIPES / "local-demo.yaml"
DATA = Path(__file__).parent / "data" / "recipes"
CLUSTER = load_cluster(DATA / "srtslurm.yaml")
LONG = "x" * 300  # one path component over NAME_MAX (255)


@pytest.fixture(autouse=True)
def _cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TILERT_CLUSTER_FILE", raising=False)
    monkeypatch.chdir(tmp_path)


def demo_text() -> str:
    return DEMO.read_text()


def load_demo(*sets: str, text: str | None = None) -> Any:
    """The demo recipe (or ``text``) loaded in-process with ``--set`` items."""
    return load_recipe_text(
        demo_text() if text is None else text,
        source="t.yaml",
        base_dir=RECIPES,
        overrides=sets,
    )


def refused(*sets: str, text: str | None = None) -> InputError:
    with pytest.raises(InputError) as info:
        load_demo(*sets, text=text)
    return info.value


def error_paths(exc: InputError) -> set[str]:
    return {p.path for p in exc.problems if p.severity == "error"}


def submit(*argv: str, timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``tilert-submit ARGV`` as a process, its memory capped at 2 GiB (a runaway cannot hurt)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run(
        [sys.executable, "-m", "submit.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=cap,
        env=clean_env(),
        **kw,
    )


def assert_clean_refusal(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    for needle in needles:
        assert needle in done.stderr, done.stderr


# ---- files --------------------------------------------------------------------------------------


def test_dev_zero_as_the_recipe_is_refused_at_once() -> None:
    started = time.monotonic()
    done = submit("/dev/zero", "--dry-run")
    assert_clean_refusal(done, "/dev/zero", "character device, not a regular file")
    assert time.monotonic() - started < 20


def test_a_fifo_as_the_recipe_or_cluster_file_does_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    assert_clean_refusal(submit(str(fifo), "--dry-run", timeout=30), "a FIFO, not a regular file")
    done = submit(str(DEMO), "--dry-run", "--cluster", str(fifo), timeout=30)
    assert_clean_refusal(done, "the cluster file is a FIFO")


def test_a_directory_as_the_cluster_file(tmp_path: Path) -> None:
    done = submit(str(DEMO), "--dry-run", "--cluster", str(tmp_path))
    assert_clean_refusal(done, "the cluster file is a directory")


def test_a_recipe_over_the_size_limit_is_refused_after_reading_one_byte_more(
    tmp_path: Path,
) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * MAX_FILE_BYTES + "\n" + demo_text())
    with pytest.raises(InputError) as info:
        load_recipe(big)
    assert "larger than 1 MiB" in str(info.value)
    with pytest.raises(InputError) as info:
        read_cluster(big)
    assert "the cluster file is larger than 1 MiB" in str(info.value)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"\xff\xfe\x00\x01binary", "not UTF-8 text: invalid byte 0xff at line 1"),
        (b"gpus_per_node: 8\nnetwork_interface: l\x00o\n", "control character '\\x00' at line 2"),
        (b"a: 1\n\x1b[31mred: 2\n", "control character '\\x1b' at line 2, column 1"),
    ],
)
def test_binary_files_give_one_clear_error(tmp_path: Path, data: bytes, needle: str) -> None:
    path = tmp_path / "bin.yaml"
    path.write_bytes(data)
    for read in (load_recipe, read_cluster):
        with pytest.raises(InputError) as info:
            read(path)
        assert len(info.value.problems) == 1
        assert needle in str(info.value)
        assert "\x00" not in str(info.value)
        assert "\x1b" not in str(info.value)
    assert_clean_refusal(submit(str(DEMO), "--dry-run", "--cluster", str(path)), needle)


def test_ename_too_long_on_every_path_is_one_error(tmp_path: Path) -> None:
    long = tmp_path / LONG
    assert_clean_refusal(submit(str(long / "r.yaml"), "--dry-run"), "File name too long")
    done = submit(str(DEMO), "--dry-run", "--cluster", str(long / "c.yaml"))
    assert_clean_refusal(done, "--cluster", "File name too long")
    done = subprocess.run(
        [sys.executable, "-m", "submit.cli", str(DEMO), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(TILERT_CLUSTER_FILE=str(long / "c.yaml")),
    )
    assert_clean_refusal(done, "TILERT_CLUSTER_FILE", "File name too long")
    done = submit(str(DEMO), "--dry-run", "--job-dir", str(long / "j"))
    assert_clean_refusal(done, "--job-dir", "File name too long")
    for command in ("status", "stop", "logs"):
        assert_clean_refusal(submit(command, str(long)))
    agent = subprocess.run(
        [*AGENT, "--role", "decode", "--job-dir", str(long)],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert_clean_refusal(agent, "File name too long")


# ---- YAML bounds --------------------------------------------------------------------------------


def alias_bomb(levels: int, width: int = 10) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_in_milliseconds() -> None:
    # Six levels of ten: a million values behind 60 aliases (nine levels: a billion, same answer).
    for levels in (6, 9):
        started = time.monotonic()
        exc = refused(text=demo_text() + alias_bomb(levels))
        assert time.monotonic() - started < 0.5
        assert f"expands to more than {MAX_NODES} values" in str(exc)
        assert len(exc.problems) == 1
        assert exc.problems[0].line is not None


def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    exc = refused(text=demo_text() + "loop: &l [1, *l]\n")
    assert "alias *l is used inside its own anchor &l" in str(exc)


def test_aliases_within_the_limits_still_work() -> None:
    text = demo_text().replace("kv-cache-dtype: bfloat16", "kv-cache-dtype: &kv bfloat16")
    assert load_demo(text=text).recipe.roles.prefill.args["kv-cache-dtype"] == "bfloat16"


@pytest.mark.parametrize(
    "nest",
    [
        "[" * 5000 + "]" * 5000,
        "{a: " * 5000 + "1" + "}" * 5000,
        "\n".join("  " * i + "k:" for i in range(MAX_DEPTH + 2)) + " 1",
    ],
    ids=["flow-lists", "flow-maps", "block-maps"],
)
def test_deep_nesting_is_refused_not_a_recursion_error(nest: str) -> None:
    exc = refused(text=demo_text() + "deep:\n  " + nest.replace("\n", "\n  ") + "\n")
    assert f"nesting deeper than {MAX_DEPTH} levels" in str(exc)


def test_deep_nesting_through_set_is_refused() -> None:
    exc = refused("roles.prefill.args.x=" + "[" * 3000 + "]" * 3000)
    assert f"nesting deeper than {MAX_DEPTH} levels" in str(exc)
    exc = refused("roles.prefill.args." + ".".join(["k"] * 3000) + "=1")
    assert "--set" in str(exc)
    assert f"more than a recipe nests ({MAX_DEPTH})" in str(exc)


def test_an_integer_of_thousands_of_digits_is_refused() -> None:
    exc = refused(text=demo_text() + "schema2: " + "9" * 5000 + "\n")
    assert "an integer of more than 64 digits" in str(exc)


def test_a_wrongly_tagged_value_is_an_error() -> None:
    exc = refused(text=demo_text().replace("max-model-len: 4096", "max-model-len: !!int abc"))
    assert "a value cannot be read" in str(exc)


# ---- numbers ------------------------------------------------------------------------------------

# (recipe key, a bad value in YAML) for every numeric setting; each is refused naming its key.
BAD_NUMBERS = [
    ("agent.router_port", "0"),
    ("agent.router_port", "65536"),
    ("agent.ports.prefill.http", "-1"),
    ("agent.ports.decode.ctrl", "70000"),
    ("agent.probe.startup_interval_s", "0"),
    ("agent.probe.interval_s", ".nan"),
    ("agent.probe.timeout_s", ".inf"),
    ("agent.probe.failure_threshold", "0"),
    ("agent.restart.backoff_initial_s", "-1"),
    ("agent.restart.backoff_max_s", "-.inf"),
    ("agent.restart.max_restarts", "-1"),
    ("agent.restart.window_s", "1.0e30"),
    ("agent.startup_budget_s.prefill", ".nan"),
    ("agent.startup_budget_s.router", "-5"),
    ("agent.stop_grace_s.decode", "-1"),
    ("agent.stop_grace_s.router", ".inf"),
    ("agent.canary.max_tokens", "0"),
    ("agent.canary.timeout_s", "0"),
    ("agent.logs.max_bytes", "0"),
    ("agent.logs.backups", "-1"),
    ("health_check.max_attempts", "0"),
    ("health_check.interval_seconds", ".nan"),
    ("resources.gpus_per_node", "-1"),
    ("roles.decode.nodes", "1000000000"),
    ("roles.decode.workers", "-2"),
    ("roles.prefill.gpus", "-1"),
]


@pytest.mark.parametrize(("key", "value"), BAD_NUMBERS, ids=[f"{k}={v}" for k, v in BAD_NUMBERS])
def test_every_number_is_checked_against_its_range(key: str, value: str) -> None:
    exc = refused(f"{key}={value}")
    assert key in error_paths(exc), str(exc)
    problem = next(p for p in exc.problems if p.path == key)
    assert "out of range" in problem.message or "finite" in problem.message
    assert problem.hint


def test_a_range_error_says_the_range_and_the_default() -> None:
    exc = refused("agent.ports.decode.http=70000")
    assert "70000 is out of range: it must be from 1 to 65535" in str(exc)
    assert "or remove it to use the default (6100)" in str(exc)


def _numbers(t: mi.Type, path: str) -> list[tuple[str, mi.IntType | mi.FloatType]]:
    """Every numeric field reachable from ``t`` (not inside free-form args or env)."""
    if isinstance(t, mi.UnionType):
        return [n for m in t.types for n in _numbers(m, path)]
    if isinstance(t, mi.IntType | mi.FloatType):
        return [(path, t)]
    if isinstance(t, mi.StructType):
        return [n for f in t.fields for n in _numbers(f.type, f"{path}.{f.encode_name}")]
    return []


@pytest.mark.parametrize("cls", [Recipe, ClusterConfig])
def test_every_numeric_setting_declares_a_range(cls: type) -> None:
    # schema is checked by its rule (it must be 2); every other number, new ones included, has a
    # declared range, or this fails naming it.
    found = [(p, t) for p, t in _numbers(mi.type_info(cls), cls.__name__) if p != "Recipe.schema"]
    assert found
    for path, t in found:
        assert t.ge is not None or t.gt is not None, f"{path} has no lower bound"
        assert t.le is not None or t.lt is not None, f"{path} has no upper bound"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("kill_wait_s", "0"),
        ("kill_wait_s", ".nan"),
        ("signal_lead_s", "-1"),
        ("gpus_per_node", "-1"),
    ],
)
def test_cluster_numbers_have_ranges(tmp_path: Path, key: str, value: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"{key}: {value}\nvisible_devices_env: not a var\n")
    with pytest.raises(InputError) as info:
        read_cluster(path)
    # Every problem in one run: the range and the unrelated name.
    assert error_paths(info.value) == {key, "visible_devices_env"}


def test_nan_in_engine_args_is_refused() -> None:
    exc = refused("roles.prefill.args.some-flag=[1, .nan]")
    assert "roles.prefill.args.some-flag[1]" in error_paths(exc)


def test_non_plain_values_in_args_are_refused() -> None:
    exc = refused(
        "roles.prefill.args.when=[2024-01-01]",
        "roles.decode.args.blob=[!!binary aGVsbG8=]",
        "roles.decode.args.pairs={x: !!set {a, b}}",
    )
    assert {
        "roles.prefill.args.when[0]",
        "roles.decode.args.blob[0]",
        "roles.decode.args.pairs.x",
    } <= error_paths(exc)


# ---- text ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("item", "path"),
    [
        ('roles.decode.args.transport="moon\\0cake"', "roles.decode.args.transport"),
        ('roles.prefill.args.x={y: ["a\\0"]}', "roles.prefill.args.x.y[0]"),
        ('roles.decode.env.GLM5_AR_N="2\\e[2J"', "roles.decode.env.GLM5_AR_N"),
        ('environment.HF_TOKEN="a\\rb"', "environment.HF_TOKEN"),
        ('name="demo\\0"', "name"),
        ('model.path="./m\\x85"', "model.path"),
        ('roles.decode.env={"A\\0B": 1}', "roles.decode.env.A\x00B"),
        ('roles.prefill.args={"max\\nlen": 1}', "roles.prefill.args.max\nlen"),
    ],
)
def test_control_characters_are_refused_with_the_key_escaped(item: str, path: str) -> None:
    exc = refused(item)
    assert path in error_paths(exc), str(exc)
    text = str(exc)
    assert "control character" in text
    # One line per message: nothing the user wrote can break or colour the report.
    for line in text.splitlines():
        assert line.isprintable(), repr(line)
    assert printable(path) in text


def test_tabs_and_newlines_in_values_are_kept() -> None:
    loaded = load_demo('roles.decode.env.NOTE="a\\tb\\nc"')
    assert loaded.recipe.roles.decode.env["NOTE"] == "a\tb\nc"


@pytest.mark.parametrize("name", ["A=B", "A B", " "])
def test_environment_names_exec_cannot_pass_are_refused(name: str) -> None:
    text = demo_text().replace('TILERT_PD_SENDERS: "1"', f'TILERT_PD_SENDERS: "1"\n  "{name}": x')
    exc = refused(text=text)
    assert f"environment.{name}" in error_paths(exc)


def test_a_job_name_too_long_for_its_directory_is_refused() -> None:
    exc = refused("name=" + "n" * 300)
    assert "name" in error_paths(exc)
    assert "more than 128" in str(exc)
    load_demo("name=" + "n" * 128)


def test_printable() -> None:
    assert printable("plain é ✓") == "plain é ✓"
    assert printable("a\nb\x00c\x1b[0m\x85\u2028") == "a\\nb\\x00c\\x1b[0m\\x85\\u2028"


def test_rendered_problems_escape_every_field() -> None:
    problem = error("roles.x\n", "bad 'a\x00b'", "fix\rit")
    text = render_problems([problem], "r\x1b.yaml")
    assert text.count("\n") == 2  # the title, the error, its fix: nothing else breaks a line
    assert "\\x00" in text
    assert "\\r" in text
    assert "\\x1b" in text
    assert "roles.x\\n" in text


# ---- agent.ports --------------------------------------------------------------------------------


def test_one_decode_port_alone_leaves_the_others_at_their_defaults() -> None:
    loaded = load_demo("agent.ports.decode.http=7000")
    ports = loaded.recipe.agent.ports
    assert (ports.decode.http, ports.decode.agent, ports.decode.ctrl) == (7000, 9200, 5600)
    assert (ports.prefill.http, ports.prefill.agent, ports.prefill.ctrl) == (8100, 9100, None)
    plan = make_plan(loaded, mock=True, launcher="process")
    assert plan.decode.port_base == {"http": 7000, "agent": 9200, "ctrl": 5600}
    # J/recipe.yaml loads again to the same ports.
    again = load_recipe_text(resolved_yaml(loaded), source="r", base_dir=RECIPES)
    assert again.recipe.agent.ports == ports


def test_one_prefill_port_alone() -> None:
    ports = load_demo("agent.ports.prefill.agent=9999").recipe.agent.ports
    assert (ports.prefill.http, ports.prefill.agent) == (8100, 9999)


# ---- the CLI's own files and pipes --------------------------------------------------------------


@pytest.fixture
def job(tmp_path: Path) -> JobDir:
    root = tmp_path / "J"
    assert main([str(DEMO), "--dry-run", "--local", "--mock", "--job-dir", str(root)]) == 0
    return JobDir(root)


def run_closed_stdout(*argv: str) -> subprocess.CompletedProcess[str]:
    """``tilert-submit ARGV`` writing into a pipe nobody reads (``| head -1`` after head left)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "submit.cli", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env=clean_env(),
        )
    finally:
        os.close(write_end)


def test_a_closed_pipe_ends_status_quietly(job: JobDir) -> None:
    for argv in (["status", str(job.root)], ["status", str(job.root), "--json"]):
        done = run_closed_stdout(*argv)
        assert (done.returncode, done.stderr) == (0, "")


def test_a_closed_pipe_ends_a_dry_run_quietly(tmp_path: Path) -> None:
    done = run_closed_stdout(str(DEMO), "--dry-run", "--job-dir", str(tmp_path / "J2"))
    assert (done.returncode, done.stderr) == (0, "")


GARBAGE_STATUS = [
    b"",
    b"garbage",
    b"\xff\xfe\x00",
    b"[]",
    b'{"state": "ready"}',
    b'{"state": "exploded", "model": "m"}',
    # An agent's row with a word outside the vocabulary (agent.job.vocab).
    b'{"state": "ready", "model": "m", "agents": [{"name": "decode-0", "role": "decode", '
    b'"index": 0, "node": null, "state": "exploded", "restarts": 0, "reason": "", "log": "", '
    b'"metrics_url": null, "status_url": null}]}',
    b'{"state": "ready", "model": "m", "local_pid": -1}',
    b'{"state": "ready", "model": "m", "local_pid": 0}',
    b'{"state": "ready", "model": "m", "slurm_job_id": "--user=root"}',
    b"[" * 100_000,
]


@pytest.mark.parametrize("data", GARBAGE_STATUS, ids=[repr(d[:40]) for d in GARBAGE_STATUS])
@pytest.mark.parametrize("command", ["status", "stop"])
def test_a_garbage_status_json_is_one_line_and_exit_2(
    job: JobDir,
    data: bytes,
    command: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    job.status.write_bytes(data)
    with pytest.raises(SystemExit) as info:
        main([command, str(job.root)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("tilert-submit: ")
    assert "status.json is not a usable job status" in err
    assert signalled == []  # nothing was signalled on the word of a garbage file


@pytest.mark.parametrize("data", [b"", b"{}", b"garbage", b'{"schema": 99}'])
def test_stop_with_a_garbage_plan_json(
    job: JobDir, data: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    job.plan.write_bytes(data)
    with pytest.raises(SystemExit) as info:
        main(["stop", str(job.root)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "plan.json is not a usable plan" in err


@pytest.mark.parametrize("data", [b"", b"\xff\x00", b"[" * 100_000, b'{"schema": 1}', b"null"])
def test_tilert_agent_with_a_garbage_plan_json(job: JobDir, data: bytes) -> None:
    job.plan.write_bytes(data)
    done = subprocess.run(
        [*AGENT, "--role", "decode", "--job-dir", str(job.root)],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert_clean_refusal(done, "plan.json")
    assert done.stderr.count("\n") == 1


def test_status_json_written_by_us_still_reads(job: JobDir) -> None:
    status = job.read_status()
    again = msgspec.json.decode(
        msgspec.json.encode(
            msgspec.structs.replace(status, local_pid=os.getpid(), slurm_job_id="123")
        ),
        type=JobStatus,
    )
    assert again.local_pid == os.getpid()
