"""J/sbatch.sh: golden scripts, bash -n + shellcheck, and inert against hostile input."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import msgspec
import pytest

from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.problems import InputError
from agent.recipe.cluster import ClusterConfig, load_cluster
from agent.recipe.loader import load_recipe
from agent.recipe.planner import make_plan
from submit.slurm.render import (
    HEADER_MARK,
    JOB_NAME_MARK,
    STEPS_MARK,
    TEMPLATE,
    VARIABLES_MARK,
    agent_command_of,
    default_agent_command,
    job_name,
    render_grow,
    render_sbatch,
    sbatch_template,
)
from tests.conftest import require
from tests.golden import GOLDEN_DIR, RECIPES, match
from tests.infra.slurm import LocalSlurm
from tests.kit import wait_for

SHELLCHECK = shutil.which("shellcheck")
REPO = Path(__file__).resolve().parents[1]
GOLDEN_JOB = JobDir(Path("/shared/jobs/glm5-run"))
GOLDEN_AGENT = ["/opt/tilert/bin/tilert-agent"]
CASES = {
    "b200-nixl-glm5": (RECIPES / "b200-nixl-glm5.yaml", RECIPES / "srtslurm.example.yaml"),
    "mi355x-mooncake-glm5": (
        RECIPES / "mi355x-mooncake-glm5.yaml",
        GOLDEN_DIR / "mi355x.cluster.yaml",
    ),
    "local-demo": (RECIPES / "local-demo.yaml", None),
}
# Shell metacharacters a recipe or a path might carry: none may ever run.
HOSTILE = "$(touch {p}) `touch {p}` ; touch {p} ' \" \\ & | > {p} $HOME"

STUB_SRUN = """#!/bin/bash
# Records its argv (NUL-separated) and exits STUB_FAIL_RC when its --role is STUB_FAIL_ROLE.
out="$STUB_LOG/srun.$$"
printf '%s\\0' "$@" > "$out"
role=""
prev=""
for a in "$@"; do
  if [ "$prev" = "--role" ]; then role="$a"; fi
  prev="$a"
done
if [ -n "${STUB_FAIL_ROLE:-}" ] && [ "$role" = "$STUB_FAIL_ROLE" ]; then
  exit "${STUB_FAIL_RC:-3}"
fi
sleep "${STUB_SLEEP:-0}"
"""
STUB_SCANCEL = """#!/bin/bash
printf '%s\\0' "$@" > "$STUB_LOG/scancel.$$"
"""


def plan_for(name: str) -> Plan:
    recipe, cluster = CASES[name]
    loaded = load_recipe(recipe, cluster=load_cluster(cluster) if cluster else None)
    return make_plan(loaded, mock=name == "local-demo")


def check_shell(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    require(SHELLCHECK is not None, "shellcheck is not installed")
    assert SHELLCHECK is not None
    done = subprocess.run([SHELLCHECK, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", ["b200-nixl-glm5", "mi355x-mooncake-glm5"])
def test_sbatch_golden(name: str) -> None:
    match(f"{name}.sbatch.sh", render_sbatch(plan_for(name), GOLDEN_JOB, GOLDEN_AGENT))


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_scripts_pass_bash_n_and_shellcheck(name: str, tmp_path: Path) -> None:
    script = tmp_path / "sbatch.sh"
    script.write_text(render_sbatch(plan_for(name), JobDir(tmp_path / "J"), GOLDEN_AGENT))
    check_shell(script)


def test_a_grow_script_runs_the_first_jobs_agent_with_the_new_indexes(tmp_path: Path) -> None:
    """``tilert-submit scale`` on Slurm: one node per new decode, ``--index`` each, the first
    job's agent command read back from its script, a watcher of the first job; shellcheck-clean."""
    plan = plan_for("b200-nixl-glm5")
    job = JobDir(tmp_path / "J")
    first = render_sbatch(plan, job, GOLDEN_AGENT)
    assert agent_command_of(first) == GOLDEN_AGENT
    text = render_grow(plan, job, agent_command_of(first), [3, 4], "4242")
    assert "#SBATCH --nodes=2" in text
    assert "sbatch-grow-3-4.out" in text
    for offset, index in enumerate([3, 4]):
        assert f"--relative={offset} " in text
        assert f'--role decode --job-dir "$JOB_DIR" --index {index} &' in text
    assert "squeue -h -j 4242" in text
    script = tmp_path / "grow.sh"
    script.write_text(text)
    check_shell(script)
    with pytest.raises(ValueError, match="not a Slurm job id"):
        render_grow(plan, job, GOLDEN_AGENT, [3], "42; rm -rf /")


def test_the_template_passes_bash_n_and_shellcheck(tmp_path: Path) -> None:
    # The static part is read by shellcheck as it is, markers and all (they are bash comments).
    template = tmp_path / TEMPLATE
    template.write_text(sbatch_template())
    for mark in (HEADER_MARK, VARIABLES_MARK, STEPS_MARK):
        assert sbatch_template().split("\n").count(mark) == 1, mark
    check_shell(template)


def test_the_template_ships_as_package_data() -> None:
    # pip installs only the files pyproject names: without this entry an installed
    # tilert-submit could not render a script (the editable install here would not notice).
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = setuptools["package-data"]["submit.slurm"]
    assert any(fnmatch.fnmatch(TEMPLATE, glob) for glob in globs), globs
    assert (REPO / "submit" / "slurm" / TEMPLATE).is_file()


def test_a_job_dir_holding_a_marker_stays_as_it_is(tmp_path: Path) -> None:
    job = JobDir(tmp_path / JOB_NAME_MARK)
    text = render_sbatch(plan_for("local-demo"), job, GOLDEN_AGENT)
    assert f"JOB_DIR={tmp_path}/{JOB_NAME_MARK}" in text
    assert JOB_NAME_MARK not in text.replace(str(job.root), "")


def test_header() -> None:
    text = render_sbatch(plan_for("b200-nixl-glm5"), GOLDEN_JOB, GOLDEN_AGENT)
    header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert header == [
        "#SBATCH --job-name=glm5-tilert-disagg",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --exclusive",
        "#SBATCH --account=my-account",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=04:00:00",
        "#SBATCH --signal=TERM@120",
        '#SBATCH --output="/shared/jobs/glm5-run/logs/sbatch.out"',
    ]


def test_no_gpu_and_shared_nodes() -> None:
    plan = plan_for("local-demo")
    plan = msgspec.structs.replace(plan, slurm=msgspec.structs.replace(plan.slurm, exclusive=False))
    text = render_sbatch(plan, GOLDEN_JOB, GOLDEN_AGENT)
    assert "--gpus-per-node" not in text
    assert "--gres" not in text
    assert "#SBATCH --exclusive" not in text
    assert "--relative=0" in text
    assert "--relative=1" in text
    assert "--nodes=2 --ntasks=2" in text  # the decode group: one agent per node


def test_output_path_quoting() -> None:
    job = JobDir(Path('/jobs/50% "done" run'))
    text = render_sbatch(plan_for("local-demo"), job, GOLDEN_AGENT)
    assert '#SBATCH --output="/jobs/50%% \\"done\\" run/logs/sbatch.out"' in text


def test_job_name_is_sanitized() -> None:
    assert job_name("glm5.3-tilert_x") == "glm5.3-tilert_x"
    assert job_name("a b$(x)`y`;\n") == "a_b__x__y___"
    assert job_name("") == "tilert"


@pytest.mark.parametrize("bad", ["/tmp/a\nb", "/tmp/a\rb", "/tmp/a\x00b", "/tmp/a\tb"])
def test_control_characters_in_the_job_dir_are_refused(bad: str) -> None:
    with pytest.raises(InputError) as info:
        render_sbatch(plan_for("local-demo"), JobDir(Path(bad)), GOLDEN_AGENT)
    assert info.value.problems[0].path == "--job-dir"


@pytest.mark.parametrize(
    ("field", "key"),
    [
        ("account", "slurm.account"),
        ("partition", "slurm.partition"),
        ("time_limit", "slurm.time_limit"),
    ],
)
def test_unsafe_header_values_are_refused(field: str, key: str) -> None:
    plan = plan_for("b200-nixl-glm5")
    slurm = msgspec.structs.replace(plan.slurm, **{field: "x\n#SBATCH --wrap=touch"})
    with pytest.raises(InputError) as info:
        render_sbatch(msgspec.structs.replace(plan, slurm=slurm), GOLDEN_JOB, GOLDEN_AGENT)
    assert info.value.problems[0].path == key


def test_default_agent_command() -> None:
    assert default_agent_command(None) == [
        os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "tilert-agent")
    ]
    site = ClusterConfig(agent_command="/opt/x/bin/tilert-agent --flag 'a b'")
    assert default_agent_command(site) == ["/opt/x/bin/tilert-agent", "--flag", "a b"]
    site = ClusterConfig(agent_command=["/opt/y/tilert-agent"])
    assert default_agent_command(site) == ["/opt/y/tilert-agent"]


# ---- running the script against stand-in srun / scancel ---------------------------------------


def stubs(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in (("srun", STUB_SRUN), ("scancel", STUB_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir, log


def run_script(
    script: Path, bin_dir: Path, log: Path, cwd: Path, **extra: str
) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_JOB_ID": "4242",
        "STUB_LOG": str(log),
        "HOME": str(cwd),
        **extra,
    }
    return subprocess.run(
        ["bash", str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=20
    )


def recorded(log: Path, prefix: str) -> list[list[str]]:
    calls = []
    for path in sorted(log.glob(f"{prefix}.*")):
        calls.append(path.read_bytes().decode().split("\0")[:-1])
    return calls


def hostile_plan(marker: Path) -> Plan:
    plan = plan_for("local-demo")
    evil = HOSTILE.format(p=marker)
    return msgspec.structs.replace(
        plan,
        name=f"demo{evil}\nrm -rf /",
        prefill=msgspec.structs.replace(
            plan.prefill, args=[*plan.prefill.args, evil], env={"EVIL": evil}
        ),
        decode=msgspec.structs.replace(plan.decode, env={"X": evil}),
        router=msgspec.structs.replace(plan.router, args=[evil]),
    )


def test_hostile_strings_render_an_inert_script(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    # The job directory itself is hostile too (legal on a file system, safe once quoted).
    job = JobDir(tmp_path / HOSTILE.format(p=marker).replace("/", "_"))
    agent = [str(tmp_path / "agent dir" / "tilert-agent"), "--flag=$(touch x)"]
    script = tmp_path / "sbatch.sh"
    text = render_sbatch(hostile_plan(marker), job, agent)
    script.write_text(text)
    name = next(line for line in text.splitlines() if line.startswith("#SBATCH --job-name="))
    assert re.fullmatch(r"#SBATCH --job-name=[A-Za-z0-9._-]+", name)
    check_shell(script)
    bin_dir, log = stubs(tmp_path)
    done = run_script(script, bin_dir, log, tmp_path)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    assert not (tmp_path / "x").exists()
    calls = recorded(log, "srun")
    assert len(calls) == 2
    by_role = {call[call.index("--role") + 1]: call for call in calls}
    for role, nodes, relative in (("prefill", 1, 0), ("decode", 2, 1)):
        call = by_role[role]
        start = call.index(agent[0])
        assert call[:start] == [
            f"--nodes={nodes}",
            f"--ntasks={nodes}",
            "--ntasks-per-node=1",
            f"--relative={relative}",
            f"--job-name={role}",
            "--export=ALL",
            "--kill-on-bad-exit=0",
        ]
        assert call[start:] == [*agent, "--role", role, "--job-dir", str(job.root)]
    assert recorded(log, "scancel") == []


def test_a_failed_step_cancels_the_job(tmp_path: Path) -> None:
    script = tmp_path / "sbatch.sh"
    script.write_text(render_sbatch(plan_for("local-demo"), JobDir(tmp_path / "J"), GOLDEN_AGENT))
    bin_dir, log = stubs(tmp_path)
    # The decode step fails at once while the prefill step is still running.
    done = run_script(script, bin_dir, log, tmp_path, STUB_FAIL_ROLE="decode", STUB_SLEEP="0.5")
    assert done.returncode == 1
    assert recorded(log, "scancel") == [["4242"]]


def test_steps_that_end_before_the_wait_are_still_collected(tmp_path: Path) -> None:
    # Both steps end at once (here: before the shell reaches `wait -n`); a clean exit must stay
    # clean and a failure must still be seen.
    script = tmp_path / "sbatch.sh"
    script.write_text(render_sbatch(plan_for("local-demo"), JobDir(tmp_path / "J"), GOLDEN_AGENT))
    bin_dir, log = stubs(tmp_path)
    done = run_script(script, bin_dir, log, tmp_path)
    assert done.returncode == 0, done.stderr
    assert recorded(log, "scancel") == []
    for path in log.iterdir():
        path.unlink()
    done = run_script(script, bin_dir, log, tmp_path, STUB_FAIL_ROLE="prefill")
    assert done.returncode == 1
    assert recorded(log, "scancel") == [["4242"]]


# ---- on the local multi-node Slurm --------------------------------------------------------------

STUB_AGENT = """#!/bin/bash
# Stand-in agent: says where it runs, drains on SIGTERM, fails at once when told to.
role="$2"
out="$(dirname "$4")/seen.$SLURMD_NODENAME"
echo "$role $SLURM_NODEID $*" > "$out"
if [ "$role" = "${STUB_FAIL_ROLE:-none}" ]; then exit 3; fi
trap 'echo drained >> "$out"; exit 0' TERM
while :; do sleep 0.1; done
"""


def submit_on_slurm(
    slurm: object, cluster_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, str]:
    import yaml

    from submit.cli import main

    agent = tmp_path / "stub-agent"
    agent.write_text(STUB_AGENT)
    agent.chmod(0o755)
    data = yaml.safe_load(cluster_file.read_text())
    data["agent_command"] = [str(agent)]
    cluster_file.write_text(yaml.safe_dump(data))
    for key, value in slurm.env.items():  # type: ignore[attr-defined]
        monkeypatch.setenv(key, value)
    root = tmp_path / "jobs" / "J"
    argv = [
        str(RECIPES / "local-demo.yaml"),
        "--cluster",
        str(cluster_file),
        "--job-dir",
        str(root),
    ]
    assert main(argv) == 0
    job_id = JobDir(root).read_status().slurm_job_id
    assert job_id
    return root, job_id


@pytest.mark.slurm
def test_on_slurm_steps_place_agents_and_drain_on_term(
    slurm: LocalSlurm,
    slurm_cluster_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, job_id = submit_on_slurm(slurm, slurm_cluster_file, tmp_path, monkeypatch)
    seen = root.parent
    wait_for(
        "a seen.* file from each of the 3 stub agents",
        lambda: len(list(seen.glob("seen.*"))) == 3,
        20,
    )
    placed = {p.suffix[1:]: p.read_text().split()[0] for p in seen.glob("seen.*")}
    # --relative: the prefill on the allocation's first node, the decode group on the next two.
    assert placed == {"node1": "prefill", "node2": "decode", "node3": "decode"}
    # SIGTERM to the steps' tasks (not --full): the agents drain and the job ends normally.
    slurm.scancel("--signal=TERM", job_id)
    assert slurm.wait_job_end(job_id, timeout=30) == "COMPLETED"
    for path in seen.glob("seen.*"):
        assert path.read_text().splitlines()[-1] == "drained"


@pytest.mark.slurm
def test_on_slurm_a_failed_step_ends_the_job(
    slurm: LocalSlurm,
    slurm_cluster_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STUB_FAIL_ROLE", "decode")
    _, job_id = submit_on_slurm(slurm, slurm_cluster_file, tmp_path, monkeypatch)
    assert slurm.wait_job_end(job_id, timeout=30) in {"CANCELLED", "FAILED"}
