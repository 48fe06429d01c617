"""The service from the user's side, in process: its recipe keys refused naming the key and the
fix (exit 2), what ``serve`` adds to the load-time rules, and ``status S`` / ``logs S`` read from
a hand-written service directory (docs/service.md, docs/cli.md)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import msgspec
import pytest

from agent.job.paths import JobDir
from agent.problems import InputError, Problem, render_problems
from agent.recipe.loader import load_recipe
from agent.recipe.rules.service import serving
from agent.recipe.serviceplan import service_plan, slurm_limit_s
from agent.service.paths import ServiceDir
from agent.service.records import CellRecord, ServiceStatus
from submit.cli import main
from tests.golden import RECIPES

DEMO = RECIPES / "local-demo.yaml"


@pytest.fixture(autouse=True)
def _cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TILERT_CLUSTER_FILE", raising=False)
    monkeypatch.chdir(tmp_path)


# ---- service keys: exit 2, the key named, how to fix it --------------------------------------


@pytest.mark.parametrize(
    ("setting", "key", "fix"),
    [
        ("service.cells=0", "service.cells", "write a number from 1 to 64"),
        ("service.front.port=70000", "service.front.port", "from 1 to 65535"),
        ("service.successor_lead_s=soon", "service.successor_lead_s", "'auto'"),
        ("service.drain_s=-1", "service.drain_s", "from 0 to 86400"),
        ("service.max_cell=3", "service.max_cell", "did you mean 'max_cells'?"),
        ("service.front.host='http://0.0.0.0:80'", "service.front.host", "no scheme or port"),
        ("service.front.host='two words'", "service.front.host", "127.0.0.1 for this machine"),
        ("service.replace.backoff_s=100", "service.replace.backoff_s", "at most backoff_max_s"),
        ("slurm.time_limit='4h'", "slurm.time_limit", "H:MM:SS"),
    ],
)
def test_a_bad_service_key_is_refused_naming_it_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setting: str, key: str, fix: str
) -> None:
    """Every recipe's service: section is checked at load, as every key is (submit --dry-run
    here; serve loads the same way)."""
    sets = ["--set", setting]
    if setting.startswith("service.replace.backoff_s"):
        sets += ["--set", "service.replace.backoff_max_s=10"]
    code = main([str(DEMO), "--dry-run", "--job-dir", str(tmp_path / "J"), *sets])
    err = capsys.readouterr().err
    assert code == 2, err
    assert key in err, err
    assert fix in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "J").exists()


def test_the_service_keys_load_with_their_defaults_and_as_set() -> None:
    loaded = load_recipe(
        DEMO,
        overrides=[
            "service.cells=2",
            "service.front={host: 0.0.0.0, port: 9000}",
            "service.successor_lead_s=50",
            "slurm.time_limit='0:30'",
        ],
    )
    plan = service_plan(loaded.recipe)
    assert (plan.cells, plan.max_cells, plan.host, plan.port) == (2, 3, "0.0.0.0", 9000)
    assert plan.successor_lead_s == 50
    # Slurm keeps whole minutes: 30 s is one minute (a 50 s lead fits in it).
    assert slurm_limit_s(loaded.recipe.slurm.time_limit) == 60
    assert plan.time_limit_s == 60


def rendered(problems: list[Problem]) -> str:
    return render_problems(problems, "t.yaml")


def test_serve_refuses_cells_that_would_get_their_term_as_they_start() -> None:
    recipe = load_recipe(DEMO, overrides=["slurm.time_limit='2'"]).recipe
    text = rendered(serving(recipe, signal_lead_s=120))
    assert "slurm.time_limit" in text, text
    assert "every cell would get its TERM as it starts" in text, text
    assert "shorter signal_lead_s in the cluster file" in text, text
    assert serving(recipe, signal_lead_s=30) == []


def test_serve_refuses_a_successor_lead_inside_the_signal_lead() -> None:
    recipe = load_recipe(
        DEMO, overrides=["slurm.time_limit='10'", "service.successor_lead_s=20"]
    ).recipe
    text = rendered(serving(recipe, signal_lead_s=30))
    assert "service.successor_lead_s" in text, text
    assert "(more than 30 s), or 'auto'" in text, text


def test_serve_refuses_a_benchmark_that_ends_its_cell() -> None:
    recipe = load_recipe(
        DEMO,
        overrides=["benchmark={type: aiperf, isl: 8, osl: 8, concurrencies: [1]}"],
    ).recipe
    text = rendered(serving(recipe, signal_lead_s=30))
    assert "benchmark.keep_serving" in text, text
    loaded = load_recipe(
        DEMO,
        overrides=[
            "benchmark={type: aiperf, isl: 8, osl: 8, concurrencies: [1], keep_serving: true}"
        ],
    )
    assert serving(loaded.recipe, signal_lead_s=30) == []


def test_max_cells_without_room_for_a_successor_is_refused_naming_it() -> None:
    recipe = load_recipe(DEMO, overrides=["service.cells=2", "service.max_cells=2"]).recipe
    with pytest.raises(InputError) as info:
        service_plan(recipe)
    assert "service.max_cells" in str(info.value)
    assert "at least 3" in str(info.value)


# ---- status S, logs S from a hand-written service directory -----------------------------------


def cell_job(service: ServiceDir, name: str) -> JobDir:
    """A cell's job directory as tilert-submit writes it (a dry run of the demo)."""
    root = service.cell(name).root
    assert main([str(DEMO), "--mock", "--dry-run", "--job-dir", str(root)]) == 0
    return JobDir(root)


def write_service(service: ServiceDir, status: ServiceStatus) -> None:
    service.status.write_bytes(msgspec.json.encode(status))


def built_service(tmp_path: Path, *, front_pid: int) -> ServiceDir:
    """A service of five cells in every state: cell-1 ready (cell-3 succeeds it, loading),
    cell-2 retiring, cell-4 waiting in Slurm's queue, cell-5 failed."""
    service = ServiceDir(tmp_path / "S")
    now = time.time()
    for name in ("cell-1", "cell-2", "cell-3", "cell-4", "cell-5"):
        cell_job(service, name)
    loading = service.cell("cell-3")
    status = loading.read_status()
    status.state = "waiting"
    status.agents[0] = msgspec.structs.replace(
        status.agents[0],
        state="starting",
        progress="Loading safetensors checkpoint shards: 40% 2/5",
        progress_at=now - 3,
    )
    loading.write_status(status)
    cells = [
        CellRecord(
            name="cell-1",
            state="ready",
            slurm_job_id="4242",
            time_left_s=7200,
            time_left_at=now - 1800,
            front_url="http://n1:8080",
            decodes=2,
            in_flight=2,
            served=130,
        ),
        CellRecord(name="cell-2", state="retiring", slurm_job_id="4240", in_flight=1, served=99),
        CellRecord(
            name="cell-3",
            reason="successor",
            follows="cell-1",
            state="starting",
            slurm_job_id="4250",
            submitted_at=now - 45,
        ),
        CellRecord(
            name="cell-4",
            reason="successor",
            follows="cell-2",
            state="submitted",
            slurm_job_id="4251",
            pending_reason="Resources",
        ),
        CellRecord(
            name="cell-5",
            reason="replacement",
            state="failed",
            slurm_job_id="4249",
            time_left_s=600,
            time_left_at=now,
            detail="prefill-0 failed: vLLM exited 1 five times in 10 min (CUDA out of memory)",
        ),
    ]
    write_service(
        service,
        ServiceStatus(
            state="serving",
            name="svc",
            front_url="http://login1:8090",
            front_pid=front_pid,
            front_started_at=now - 3600,
            backend="slurm",
            cells=cells,
            requests={"ok": 228, "retried_ok": 1},
            successions=3,
            replacements=1,
        ),
    )
    return service


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_status_of_a_service_is_a_table_of_its_cells(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    service = built_service(tmp_path, front_pid=os.getpid())
    capsys.readouterr()
    assert main(["status", str(service.root)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "service: serving", out
    assert "front: http://login1:8090 (pid" in out, out
    assert "requests: ok 228, retried_ok 1; successions 3, replacements 1" in out, out
    header = next(line for line in lines if line.startswith("CELL"))
    names = "CELL JOB NODES STATE TIME LEFT IN FLIGHT SERVED NEXT DETAIL"
    assert header.split() == names.split(), out
    table = lines[lines.index(header) + 1 :]
    rows = {line.split()[0]: line for line in table[: table.index("")]}
    # cell-1: Slurm's 2 h read half an hour ago; 3 nodes (the demo's plan); cell-3 succeeds it.
    assert re.search(
        r"^cell-1\s+4242\s+3\s+ready\s+1:(29:[0-5]\d|30:00)\s+2\s+130\s+cell-3 successor "
        r"\(starting\)",
        rows["cell-1"],
    ), out
    assert re.search(r"^cell-2\s+4240\s+3\s+retiring\s+-\s+1\s+99\s+cell-4", rows["cell-2"]), out
    assert "pending: Resources" in rows["cell-4"], out
    # A cell that has ended has no time left, whatever Slurm last said.
    assert re.search(r"^cell-5\s+4249\s+3\s+failed\s+-\s", rows["cell-5"]), out
    assert "successor of cell-1" in rows["cell-3"], out
    # The loading successor's own progress, from its status.json.
    # (the seconds as they pass while the cells' directories are written: not what is checked)
    assert re.search(
        r"\ncell-3 \(successor, \d+s since submitted\): job waiting: prefill-0 starting", out
    ), out
    assert re.search(
        r"\n  prefill-0 progress \(\d+s ago\): Loading safetensors checkpoint shards: 40% 2/5", out
    ), out
    assert "cell-5 failed: prefill-0 failed: vLLM exited 1 five times in 10 min (CUDA" in out


def test_status_json_and_a_gone_front_is_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    service = built_service(tmp_path, front_pid=dead_pid())
    capsys.readouterr()
    assert main(["status", str(service.root), "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["stale"] is True
    assert "the service front (pid" in view["stale_reason"]
    assert [c["name"] for c in view["service"]["cells"]][:2] == ["cell-1", "cell-2"]
    assert main(["status", str(service.root)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("service: serving (STALE: the service front (pid"), first
    assert "tilert-submit serve on this directory adopts them" in first, first


def test_status_of_a_broken_service_json_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    service = ServiceDir(tmp_path / "S")
    service.root.mkdir()
    service.status.write_text('{"state": "serving"}')
    with pytest.raises(SystemExit) as info:
        main(["status", str(service.root)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "service.json is not a usable service status" in err, err
    assert "Traceback" not in err


def test_logs_of_a_service_print_its_front_log_or_a_cells(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    service = built_service(tmp_path, front_pid=os.getpid())
    service.log.write_text("line 1\nsubmitted cell-3 (successor of cell-1)\nline 3\n")
    agent_log = service.cell("cell-1").log_dir("prefill-0") / "agent.log"
    agent_log.parent.mkdir(parents=True, exist_ok=True)
    agent_log.write_text("the agent of cell-1 speaks\n")
    capsys.readouterr()
    assert main(["logs", str(service.root), "--tail", "2"]) == 0
    assert capsys.readouterr().out == "submitted cell-3 (successor of cell-1)\nline 3\n"
    assert main(["logs", str(service.root), "cell-1", "prefill-0", "--agent"]) == 0
    assert "the agent of cell-1 speaks" in capsys.readouterr().out
    assert main(["logs", str(service.root), "cell-9"]) == 2
    err = capsys.readouterr().err
    assert "has no cell 'cell-9'; its cells: cell-1, cell-2, cell-3, cell-4, cell-5" in err, err


def test_the_local_service_demo_plans_as_its_comments_say(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """recipes/local-service.yaml: serve --dry-run passes every rule with the default signal
    lead (no cluster file) and plans 2 cells of 2 nodes with the lead and limit it describes."""
    recipe = RECIPES / "local-service.yaml"
    sdir = tmp_path / "S"
    code = main(
        ["serve", str(recipe), "--local", "--mock", "--dry-run", "--service-dir", str(sdir)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "cells: 2 (at most 4 at once during a succession)" in out, out
    assert "cells' time limit: 240 s; successor lead: 170 s; drain: 30 s" in out, out
    assert "node 1   decode-0" in out, out
    assert "decode-1" not in out, out


def test_logs_f_of_a_service_that_has_stopped_prints_its_log_and_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``logs S -f`` follows the front's log until the service has stopped and its front is
    gone: here both already, so it prints the log and returns at once."""
    service = built_service(tmp_path, front_pid=dead_pid())
    status = msgspec.json.decode(service.status.read_bytes(), type=ServiceStatus)
    status.state = "stopped"
    write_service(service, status)
    service.log.write_text("submitted cell-1\nstopped\n")
    capsys.readouterr()
    assert main(["logs", str(service.root), "-f"]) == 0
    assert capsys.readouterr().out == "submitted cell-1\nstopped\n"
