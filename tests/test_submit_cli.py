"""tilert-submit: the job directory, --dry-run, --set, bad input, and submit via a stand-in
sbatch."""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.job.paths import JobDir
from agent.job.plan import load_plan
from agent.job.records import FrontSummary, QueueSummary
from agent.recipe.loader import load_recipe
from agent.recipe.model import agent_keys
from agent.recipe.planner import make_plan
from submit.backend import Submitted
from submit.cli import main, submitted_text
from submit.statusview import front_line
from tests import kit
from tests.golden import GOLDEN_DIR, RECIPES

RECIPE_CASES = {
    "b200": (RECIPES / "b200-nixl-glm5.yaml", RECIPES / "srtslurm.example.yaml"),
    "mi355x": (RECIPES / "mi355x-mooncake-glm5.yaml", GOLDEN_DIR / "mi355x.cluster.yaml"),
    "demo": (RECIPES / "local-demo.yaml", None),
}
DEMO = RECIPES / "local-demo.yaml"

STUB_SBATCH = """#!/bin/bash
# Stand-in sbatch: records argv and the secret it was given, prints a job id like --parsable.
printf '%s\\n' "$@" > "$STUB_LOG/sbatch.argv"
printf '%s' "${DEMO_API_KEY:-unset}" > "$STUB_LOG/sbatch.secret"
echo "777;local"
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test in its own working directory, with no cluster file found by accident."""
    monkeypatch.delenv("TILERT_CLUSTER_FILE", raising=False)
    monkeypatch.chdir(tmp_path)


def args_for(case: str, job: Path, *extra: str) -> list[str]:
    recipe, cluster = RECIPE_CASES[case]
    argv = [str(recipe), "--job-dir", str(job), *extra]
    if cluster is not None:
        argv += ["--cluster", str(cluster)]
    return argv


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
def test_dry_run_lays_out_the_job_directory(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "J"
    assert main(args_for(case, root, "--dry-run")) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"Job directory: {root}"
    assert "Dry run: nothing submitted." in out
    assert "<agent>" in out  # managed args shown as placeholders
    assert sorted(p.name for p in root.iterdir()) == [
        "logs",
        "plan.json",
        "prometheus",
        "recipe.yaml",
        "rendezvous",
        "sbatch.sh",
        "status.json",
        "token",
    ]
    assert mode(root) == 0o711
    assert mode(root / "token") == 0o600
    assert mode(root / "rendezvous") == 0o700
    assert mode(root / "logs") == 0o700
    assert mode(root / "prometheus") == 0o755
    assert mode(root / "prometheus" / "targets.json") == 0o644
    assert mode(root / "status.json") == 0o644
    assert list((root / "rendezvous").iterdir()) == []
    job = JobDir(root)
    status = job.read_status()
    assert status.state == "pending"
    assert status.slurm_job_id is None
    assert status.router_url is None
    plan = load_plan(job.plan.read_bytes())
    assert status.model == plan.model
    assert [a.name for a in status.agents] == [
        f"prefill-{i}" for i in range(plan.prefill.nodes)
    ] + [f"decode-{i}" for i in range(plan.decode.nodes)]
    assert str(root) in job.sbatch.read_text()
    # The agents re-load J/recipe.yaml without the cluster file and get the same launch plan.
    again = make_plan(load_recipe(job.recipe, on_submit_host=False), mock=plan.standins)
    for role in ("prefill", "decode"):
        assert again.role(role).program == plan.role(role).program
        assert again.role(role).args == plan.role(role).args
        assert again.role(role).env == plan.role(role).env
        assert again.role(role).image == plan.role(role).image
    assert again.router.args == plan.router.args


def test_dry_run_local_mock_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "J"
    assert main([str(DEMO), "--dry-run", "--local", "--mock", "--job-dir", str(root)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # the demo validates with no warning
    plan = load_plan((root / "plan.json").read_bytes())
    assert plan.standins == ["prefill", "decode", "router"]
    assert plan.launcher == "process"
    assert plan.network_interface == "lo"  # --local: everything on loopback
    assert "agent.standins.prefill" in captured.out


@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
def test_dry_run_shows_every_agent_key(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The keys come from the recipe model: a key added to AgentSection without a line in
    # submit/show.py's _AGENT_VALUES fails here.
    assert main([*args_for(case, tmp_path / "J"), "--dry-run"]) == 0
    rows = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.strip()}
    for key in agent_keys():
        assert key in rows, f"{key} is not in the --dry-run output"
        assert "(not shown by --dry-run)" not in rows[key]


def test_dry_run_shows_the_recipe_s_agent_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(DEMO), "--dry-run", "--job-dir", str(tmp_path / "J")]
    argv += ["--set", "agent.max_rejoins=7", "--set", "agent.restart.window_s=123"]
    assert main(argv) == 0
    rows = {
        ln.split()[0]: ln.split()[1:] for ln in capsys.readouterr().out.splitlines() if ln.strip()
    }
    assert rows["agent.max_rejoins"] == ["7"]
    assert rows["agent.restart.window_s"] == ["123", "s"]


def test_default_job_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(DEMO), "--dry-run"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    root = Path(first.removeprefix("Job directory: "))
    assert root.parent == tmp_path / "tilert-jobs"
    assert root.name.startswith("local-demo-")
    stamp = root.name.removeprefix("local-demo-")
    assert len(stamp) == len("20260101-120000")
    assert stamp[8] == "-"
    # A second run in the same second gets its own directory.
    assert main([str(DEMO), "--dry-run"]) == 0
    second = Path(capsys.readouterr().out.splitlines()[0].removeprefix("Job directory: "))
    assert second != root
    assert second.parent == root.parent


def test_set_round_trip(tmp_path: Path) -> None:
    root = tmp_path / "J"
    argv = [
        str(DEMO),
        "--dry-run",
        "--job-dir",
        str(root),
        "--set",
        "roles.prefill.env.MY_FLAG=1",
        "--set",
        "agent.router_port=8123",
        "--set",
        "roles.decode.args.pd-buffer-device=cpu",
        "--set",
        "environment.DEMO_API_KEY=s3cr3t-value",
    ]
    assert main(argv) == 0
    plan = load_plan((root / "plan.json").read_bytes())
    assert plan.prefill.env["MY_FLAG"] == "1"
    assert plan.router.port == 8123
    assert plan.decode.args[-2:] == ["--pd-buffer-device", "cpu"]
    assert "DEMO_API_KEY" in plan.prefill.secret_env
    recipe_text = (root / "recipe.yaml").read_text()
    assert "MY_FLAG" in recipe_text
    assert "8123" in recipe_text
    # Secrets are masked in everything written.
    for path in root.rglob("*"):
        if path.is_file():
            assert "s3cr3t-value" not in path.read_text(), path
    again = make_plan(load_recipe(root / "recipe.yaml", on_submit_host=False), mock=False)
    assert again.prefill.env == plan.prefill.env
    assert again.decode.args == plan.decode.args
    assert again.router.port == 8123


def test_bad_set_exits_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "J"
    assert main([str(DEMO), "--dry-run", "--job-dir", str(root), "--set", "roles.decode"]) == 2
    err = capsys.readouterr().err
    assert "--set roles.decode" in err
    assert not root.exists()


def test_non_empty_job_dir_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "J"
    root.mkdir()
    (root / "keep.txt").write_text("mine")
    assert main([str(DEMO), "--dry-run", "--job-dir", str(root)]) == 2
    assert "--job-dir" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == ["keep.txt"]


def test_empty_job_dir_is_used(tmp_path: Path) -> None:
    root = tmp_path / "J"
    root.mkdir()
    assert main([str(DEMO), "--dry-run", "--job-dir", str(root)]) == 0
    assert (root / "plan.json").exists()


def test_job_dir_with_a_newline_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "a\nb"
    assert main([str(DEMO), "--dry-run", "--job-dir", str(root)]) == 2
    assert "--job-dir" in capsys.readouterr().err
    assert not root.exists()


def test_bad_recipe_exits_2_with_every_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(DEMO.read_text().replace("name: local-demo", "name: 'x$(touch y)'"))
    assert main([str(bad), "--dry-run", "--job-dir", str(tmp_path / "J")]) == 2
    err = capsys.readouterr().err
    assert "name" in err
    assert "Traceback" not in err
    assert not (tmp_path / "J").exists()


def test_warnings_go_to_stderr_and_exit_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args_for("b200", tmp_path / "J", "--dry-run")) == 0
    captured = capsys.readouterr()
    assert "warning" in captured.err
    assert "model.path" in captured.err
    assert captured.out.startswith("Job directory: ")
    assert "warning:" not in captured.out


def test_console_script_never_prints_a_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "submit.cli", str(tmp_path / "missing.yaml"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "missing.yaml" in done.stderr


def test_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([str(DEMO), "--dry-runn"])
    assert info.value.code == 2
    assert "--dry-runn" in capsys.readouterr().err


# ---- submitting -------------------------------------------------------------------------------


def stand_in_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir, log = tmp_path / "bin", tmp_path / "stub-log"
    bin_dir.mkdir()
    log.mkdir()
    (bin_dir / "sbatch").write_text(STUB_SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("STUB_LOG", str(log))
    return log


def test_submit_records_the_slurm_job_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = stand_in_sbatch(tmp_path, monkeypatch)
    monkeypatch.delenv("DEMO_API_KEY", raising=False)
    root = tmp_path / "J"
    argv = [str(DEMO), "--job-dir", str(root), "--set", "environment.DEMO_API_KEY=s3cr3t-value"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"Job directory: {root}"
    assert "Submitted Slurm job 777" in out
    assert f"  tilert-submit status {root}" in out
    assert f"  tilert-submit logs {root} -f" in out
    assert f"  tilert-submit stop {root}" in out
    status = JobDir(root).read_status()
    assert status.slurm_job_id == "777"
    assert status.state == "pending"
    argv_seen = (log / "sbatch.argv").read_text().splitlines()
    assert argv_seen == ["--parsable", "--export=ALL", str(root / "sbatch.sh")]
    # The recipe's secret reached sbatch through its environment, and no file holds it.
    assert (log / "sbatch.secret").read_text() == "s3cr3t-value"
    for path in root.rglob("*"):
        if path.is_file():
            assert "s3cr3t-value" not in path.read_text()


def test_submit_without_slurm_exits_1_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    root = tmp_path / "J"
    assert main([str(DEMO), "--job-dir", str(root)]) == 1
    err = capsys.readouterr().err
    assert "sbatch is not on PATH" in err
    assert "--local" in err
    status = JobDir(root).read_status()
    assert status.state == "failed"
    assert status.error
    assert "sbatch" in status.error


def test_sbatch_refusal_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stand_in_sbatch(tmp_path, monkeypatch)
    (tmp_path / "bin" / "sbatch").write_text(
        "#!/bin/sh\necho 'sbatch: error: Invalid account or account/partition combination' >&2\n"
        "exit 1\n"
    )
    assert main([str(DEMO), "--job-dir", str(tmp_path / "J")]) == 1
    assert "Invalid account" in capsys.readouterr().err


# ---- job commands -----------------------------------------------------------------------------


def test_status_dispatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "J"
    assert main([str(DEMO), "--dry-run", "--job-dir", str(root)]) == 0
    capsys.readouterr()
    assert main(["status", str(root), "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert json.dumps(view).count("pending") >= 1


# ``tilert-submit ARGS`` in a fresh interpreter, then every module it imported (read before the
# probe imports json to write them).
IMPORT_PROBE = """
import sys
from submit.cli import main
try:
    code = main(sys.argv[2:])
except SystemExit as exc:
    code = exc.code
modules = sorted(sys.modules)
import json
with open(sys.argv[1], "w") as out:
    json.dump({"code": code, "modules": modules}, out)
"""
# What a job command and --help must not pay for (docs/performance.md, "CLI imports"): the
# recipe layer and its YAML, psutil, subprocess, the sbatch renderer, the writers' tempfile and
# secrets; for --help also the job's formats and the backends (it reads agent.recipe.sweep, for
# --max-jobs' default). Each is imported where it is used; each costs a good part of an
# interpreter's start.
NOT_FOR_STATUS = ("agent.recipe", "yaml", "psutil", "subprocess", "submit.slurm.render")
NOT_FOR_STATUS_EITHER = ("tempfile", "secrets", "agent.job.atomicfile")
NOT_FOR_HELP = (
    *("agent.recipe.loader", "agent.recipe.cluster", "agent.recipe.planner", "yaml", "psutil"),
    *("subprocess", "agent.job", "submit.backend", "submit.slurm", "submit.statusview"),
)


def imported_by(tmp_path: Path, *argv: str) -> set[str]:
    """The modules ``tilert-submit ARGV`` imports, run in a fresh interpreter (exit 0)."""
    found = tmp_path / "modules.json"
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, str(found), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(found.read_text())
    assert result["code"] in (0, None), (result["code"], done.stdout, done.stderr)
    return set(result["modules"])


def heavy(modules: set[str], names: tuple[str, ...]) -> list[str]:
    """The modules among ``modules`` that are one of ``names`` or inside one."""
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


def test_status_and_help_import_only_what_they_use(tmp_path: Path) -> None:
    """``status`` of a live local job (the stale check asks whether its supervisor's pid runs,
    as ``python -m tests.bench``'s ``cli_status_ms`` measures) and ``--help`` import neither the
    recipe layer nor psutil nor subprocess: asserted on what they import, not on time."""
    root = tmp_path / "J"
    assert main([str(DEMO), "--dry-run", "--job-dir", str(root)]) == 0
    job = JobDir(root)
    status = job.read_status()
    status.state, status.local_pid, status.updated_at = "ready", os.getpid(), time.time()
    job.write_status(status)
    modules = imported_by(tmp_path, "status", str(root))
    assert "submit.statusview" in modules
    assert "submit.local.backend" in modules  # the live pid asked after
    assert heavy(modules, NOT_FOR_STATUS + NOT_FOR_STATUS_EITHER) == []
    modules = imported_by(tmp_path, "--help")
    assert "argparse" in modules
    assert heavy(modules, NOT_FOR_HELP) == []


def test_a_dry_run_of_a_schema_2_recipe_imports_no_runtime_and_no_schema_1_reader(
    tmp_path: Path,
) -> None:
    """``--dry-run`` plans and prints: neither the launchers' runtime (trio, psutil, subprocess,
    httpx) nor the schema-1 reader, which a recipe that says ``schema: 2`` cannot need."""
    root = tmp_path / "J"
    modules = imported_by(tmp_path, str(DEMO), "--dry-run", "--job-dir", str(root))
    assert "agent.recipe.planner" in modules
    assert heavy(modules, ("agent.recipe.schema1", "trio", "psutil", "subprocess", "httpx")) == []


def test_what_a_person_reads_once_submitted_names_the_handle(tmp_path: Path) -> None:
    # The backends return a handle; the words are the CLI's (a local run never returns one today:
    # it becomes the supervisor, but a handle naming a pid reads as well).
    job = JobDir(tmp_path / "my job")
    slurm = submitted_text(Submitted(job=job, slurm_job_id="42")).splitlines()
    assert slurm[:2] == ["Submitted Slurm job 42", "Follow it with:"]
    assert f"  tilert-submit logs '{job.root}' -f" in slurm
    local = submitted_text(Submitted(job=job, local_pid=4242)).splitlines()
    assert local[0] == "Submitted the local supervisor, pid 4242"


def test_status_reads_every_word_a_row_has_ever_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The rows' states and roles are typed (agent.job.vocab): a status.json written before the
    # types, with any word the head or the submitter ever wrote, still reads.
    root = tmp_path / "J"
    assert main([str(DEMO), "--dry-run", "--job-dir", str(root)]) == 0
    data = json.loads(JobDir(root).status.read_text())
    row = data["agents"][0]
    words = ["pending", "missing", "starting", "converting", "healthy", "unhealthy"]
    words += ["restarting", "unreachable", "stopping", "stopped", "failed"]
    data["agents"] = [{**row, "name": f"decode-{i}", "state": w} for i, w in enumerate(words)]
    data["router"] = {**row, "name": "router", "role": "router", "state": "healthy"}
    JobDir(root).status.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["status", str(root)]) == 0
    shown = capsys.readouterr().out
    assert all(f"decode-{i}" in shown and word in shown for i, word in enumerate(words))


def test_status_warns_when_the_router_tokenization_fell_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "J"
    assert main([str(DEMO), "--dry-run", "--job-dir", str(root)]) == 0
    data = json.loads(JobDir(root).status.read_text())
    data["router_tokenize"] = {"on": True, "requests": 10, "fallback": 0}
    JobDir(root).status.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["status", str(root)]) == 0
    assert "warning" not in capsys.readouterr().out
    data["router_tokenize"] = {"on": False, "requests": 10, "fallback": 2}
    JobDir(root).status.write_text(json.dumps(data))
    assert main(["status", str(root)]) == 0
    shown = capsys.readouterr().out
    assert "warning: the router's own tokenization fell back" in shown
    assert "for 2 of 10 chats (now OFF)" in shown


def test_a_recipe_named_like_a_command(tmp_path: Path) -> None:
    (tmp_path / "status").write_text(
        DEMO.read_text().replace("./local-demo-model", str(RECIPES / "local-demo-model"))
    )
    assert main(["./status", "--dry-run", "--job-dir", str(tmp_path / "J")]) == 0


@pytest.mark.parametrize(
    ("flags", "standins"),
    [
        (["--mock"], ["prefill", "decode", "router"]),
        (["--mock", "decode"], ["decode"]),
        (["--mock=router,prefill"], ["prefill", "router"]),
        (["--mock", "all"], ["prefill", "decode", "router"]),
        ([], []),
    ],
)
def test_mock_names_the_roles_it_replaces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], standins: list[str]
) -> None:
    root = tmp_path / "J"
    assert main([str(DEMO), "--dry-run", "--local", *flags, "--job-dir", str(root)]) == 0
    plan = load_plan((root / "plan.json").read_bytes())
    assert plan.standins == standins
    out = capsys.readouterr().out
    stand_ins = next(line for line in out.splitlines() if line.startswith("  stand-ins:"))
    for name in ("prefill", "decode"):
        assert (name in stand_ins) == (name in standins), stand_ins
    # The prefill's command is the stand-in only when it is named.
    assert ("agent.standins.prefill" in out) == ("prefill" in standins)
    assert "agent.prefill_command" in out
    assert "agent.decode_python" in out
    status = JobDir(root).read_status()
    assert status.standins == [n for n in standins if n != "router"]


def test_mock_before_the_recipe_still_means_every_role(tmp_path: Path) -> None:
    root = tmp_path / "J"
    assert main(["--mock", str(DEMO), "--dry-run", "--job-dir", str(root)]) == 0
    assert load_plan((root / "plan.json").read_bytes()).standins == ["prefill", "decode", "router"]


def test_mock_with_an_unknown_role_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([str(DEMO), "--dry-run", "--mock", "decoder", "--job-dir", str(tmp_path / "J")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --mock: 'decoder' is not a role" in err
    assert "prefill, decode, router" in err


def test_prefill_command_and_decode_python_reach_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "J"
    sets = [
        "--set",
        "agent.prefill_command=[/opt/site/bin/launch-vllm, --profile, big]",
        "--set",
        "agent.decode_python=/opt/tilert/bin/python",
    ]
    assert main([str(DEMO), "--dry-run", *sets, "--job-dir", str(root)]) == 0
    plan = load_plan((root / "plan.json").read_bytes())
    assert plan.prefill.program == [
        "/opt/site/bin/launch-vllm",
        "--profile",
        "big",
        str(RECIPES / "local-demo-model"),
    ]
    assert plan.decode.program == ["/opt/tilert/bin/python", "-m", "tilert.pd_vllm.decode_server"]
    out = capsys.readouterr().out
    assert "/opt/site/bin/launch-vllm --profile big (agent.prefill_command)" in out
    assert f"/opt/site/bin/launch-vllm --profile big {RECIPES / 'local-demo-model'}" in out


def test_dry_run_masks_the_secret(tmp_path: Path) -> None:
    """The dry run's output and job directory hold no secret value."""
    secret = f"s3cr3t-value-{secrets.token_hex(4)}"
    job_dir = tmp_path / "J"
    done = kit.submit_cmd(
        str(kit.DEMO_RECIPE),
        "--dry-run",
        "--job-dir",
        str(job_dir),
        "--set",
        f"roles.prefill.env.HF_TOKEN={secret}",
        env=kit.clean_env(),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert secret not in done.stdout + done.stderr
    assert "HF_TOKEN" in (job_dir / "recipe.yaml").read_text()
    for path in job_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_the_front_line_shows_the_queue_and_its_refusals() -> None:
    # "refused", not "429": a request that waited with no decode in the router's list is a 503.
    queue = QueueSummary(waiting=2, oldest_wait_s=1.25, admitted=2, capacity=2, refused={"full": 3})
    line = front_line(FrontSummary(requests={"ok": 12}, in_flight=2, queue=queue))
    assert line == (
        "front requests: ok 12; in flight 2; queue: 2 waiting (oldest 1.2s), 2/2 at the router, "
        "refused: full 3"
    )
