"""The weights feature's parts without agents: the recipe keys, the plan, the folder check, the
path mapping and the stand-in converter (run as a real process); the lock is
tests/test_folderlock.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import yaml

from agent.job.logfiles import log_files, log_path
from agent.job.paths import JobDir
from agent.job.plan import load_plan
from agent.node.hubcache import HubCacheError, snapshot
from agent.node.weightsfolder import (
    MARKER_NAME,
    ConvertedMarker,
    WeightsError,
    inspect,
    replace_folder,
    sha256_file,
    weights_paths,
    write_marker,
)
from agent.problems import InputError
from agent.recipe.cluster import ClusterConfig, load_cluster
from agent.recipe.convertplan import convert_job_plan
from agent.recipe.loader import load_recipe_text
from agent.recipe.planner import make_plan

DATA = Path(__file__).parent / "data" / "recipes"
CLUSTER = load_cluster(DATA / "srtslurm.yaml")
CONVERTER = [sys.executable, "-m", "agent.standins.converter"]


# ---- helpers -------------------------------------------------------------------------------


def b200(**convert: Any) -> dict[str, Any]:
    """The b200 recipe with ``roles.decode.convert`` set to ``convert`` (when given)."""
    data = yaml.safe_load((DATA / "b200-nixl-glm5.yaml").read_text())
    if convert:
        data["roles"]["decode"]["convert"] = convert
    return cast(dict[str, Any], data)


def load(data: dict[str, Any], cluster: ClusterConfig | None = CLUSTER) -> Any:
    text = yaml.safe_dump(data, sort_keys=False)
    return load_recipe_text(text, source="t.yaml", base_dir=DATA, cluster=cluster)


def problems(data: dict[str, Any]) -> dict[str, str]:
    """``{key path: message}`` of every error loading ``data``."""
    with pytest.raises(InputError) as info:
        load(data)
    return {p.path: p.message for p in info.value.problems if p.severity == "error"}


def checkpoint(folder: Path) -> Path:
    """A Hugging Face checkpoint as far as the converter stand-in reads it: its index."""
    folder.mkdir(parents=True, exist_ok=True)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "m-1.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text("{}")  # read by the converter, checked at submit
    return folder


def convert(
    save: Path, src: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the converter stand-in to its end."""
    argv = [*CONVERTER, "--model_type", "glm-5", "--model_dir", str(src), "--save_dir", str(save)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    return subprocess.run(
        [*argv, *flags], capture_output=True, text=True, env={**clean, **(env or {})}, timeout=60
    )


def mark(folder: Path) -> None:
    """Write the completion marker for a converted folder, as the agent would."""
    found = inspect(folder, marker_required=False)
    assert not found.problems, found.problems
    write_marker(
        folder,
        ConvertedMarker(
            converter="test",
            converter_version="0",
            source="/hf",
            model_type="glm-5",
            append_mtp=False,
            converted_at=time.time(),
            converted_at_utc="now",
            index_file="model.safetensors.index.json",
            index_sha256=found.index_sha256 or "",
            shards=found.shard_count,
            total_bytes=found.total_bytes,
            agent="decode-0",
            node="n",
            job="/j",
        ),
    )


@pytest.fixture
def converted(tmp_path: Path) -> Path:
    """A complete folder: converted by the stand-in, marked."""
    folder = tmp_path / "w"
    done = convert(folder, checkpoint(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    mark(folder)
    return folder


# ---- recipe keys and the plan -----------------------------------------------------------------


def test_convert_keys_load_and_plan() -> None:
    loaded = load(b200(source="/models/GLM-5.1-FP8"))
    plan = make_plan(loaded, mock=False)
    assert not isinstance(plan.convert, msgspec.UnsetType)
    assert plan.convert.model_type == "glm-5"  # from the decode model profile glm5
    assert plan.convert.program == ["python", "-m", "tilert.models.preprocess.weight_converter"]
    assert plan.convert.source == "/models/GLM-5.1-FP8"
    again = load_plan(msgspec.json.encode(plan))
    assert again.convert == plan.convert


def test_plan_without_convert_has_no_convert_key() -> None:
    plan = make_plan(load(b200()), mock=False)
    assert "convert" not in json.loads(msgspec.json.encode(plan))


def test_source_alias_resolves_through_model_paths() -> None:
    cluster = msgspec.structs.replace(CLUSTER, model_paths={"glm5-hf": "/shared/hf/GLM-5"})
    loaded = load(b200(source="glm5-hf"), cluster)
    assert loaded.recipe.roles.decode.convert.source == "/shared/hf/GLM-5"


@pytest.mark.parametrize(
    ("convert", "edit", "key", "words"),
    [
        ({"source": "/hf", "model_type": "deepseek-v32"}, None, "model_type", "needs 'glm-5'"),
        ({"source": "/hf", "model_type": "glm5"}, None, "model_type", "no model type"),
        ({"source": "/hf", "append_mtp": True}, ("with-mtp", None), "append_mtp", "with-mtp"),
        ({}, None, "source", "no checkpoint"),
        ({"source": "/tilert_weights/glm5.1-fp8/hf"}, None, "source", "inside the weights"),
        ({"source": "/hf", "python": " "}, None, "python", "empty"),
    ],
)
def test_convert_key_problems(
    convert: dict[str, Any], edit: tuple[str, Any] | None, key: str, words: str
) -> None:
    data = b200(**convert) if convert else b200()
    if not convert:
        data["roles"]["decode"]["convert"] = {}
    if edit is not None:
        data["roles"]["decode"]["args"][edit[0]] = edit[1]
    found = problems(data)
    path = f"roles.decode.convert.{key}"
    assert path in found, found
    assert words in found[path], found[path]


def test_a_hub_id_source_is_a_warning_naming_the_cache_it_is_read_from() -> None:
    loaded = load(b200(source="hf:zai-org/GLM-5"))
    (warned,) = [w for w in loaded.warnings if w.path == "roles.decode.convert.source"]
    assert "Hugging Face cache (HF_HUB_CACHE" in warned.message
    plan = make_plan(loaded, mock=False)
    assert not isinstance(plan.convert, msgspec.UnsetType)
    assert plan.convert.source == "zai-org/GLM-5"


def test_a_source_folder_this_host_reads_must_hold_what_the_converter_reads(
    tmp_path: Path,
) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors.index.json").write_text("{}")
    found = problems(b200(source=str(hf)))
    assert "has no config.json" in found["roles.decode.convert.source"]
    (hf / "config.json").write_text("{}")
    loaded = load(b200(source=str(hf)))
    assert [w for w in loaded.warnings if w.path == "roles.decode.convert.source"] == []
    # A folder this host cannot see is the node's to check: a warning that says so.
    loaded = load(b200(source=str(tmp_path / "elsewhere")))
    (warned,) = [w for w in loaded.warnings if w.path == "roles.decode.convert.source"]
    assert "checked on the decode node" in warned.message


def test_a_hub_ids_snapshot_is_found_in_the_cache_as_snapshot_download_finds_it(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--zai-org--GLM-5.1-FP8"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "old999").mkdir(parents=True)
    env = {"HF_HOME": str(tmp_path), "PATH": "/bin"}
    with pytest.raises(HubCacheError, match="refs/main"):  # two snapshots, no ref: which one?
        snapshot("zai-org/GLM-5.1-FP8", env, [], "process")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    assert snapshot("zai-org/GLM-5.1-FP8", env, [], "process") == f"{repo}/snapshots/abc123"
    with pytest.raises(HubCacheError, match="huggingface-cli download zai-org/other"):
        snapshot("zai-org/other", {"HF_HUB_CACHE": str(cache)}, [], "process")
    # Under pyxis the cache is a container path: read through the mount that holds it.
    env = {"HF_HUB_CACHE": "/hf_hub_cache/hub"}
    found = snapshot("zai-org/GLM-5.1-FP8", env, [f"{cache}:/hf_hub_cache/hub"], "pyxis")
    assert found == "/hf_hub_cache/hub/models--zai-org--GLM-5.1-FP8/snapshots/abc123"
    with pytest.raises(HubCacheError, match="not under any of the job's container mounts"):
        snapshot("zai-org/GLM-5.1-FP8", env, [f"{cache}:/elsewhere"], "pyxis")


def test_convert_needs_an_absolute_weights_dir() -> None:
    data = b200(source="/hf")
    del data["roles"]["decode"]["args"]["model-weights-dir"]
    assert "roles.decode.args.model-weights-dir" in problems(data)
    data["roles"]["decode"]["args"]["model-weights-dir"] = "weights/glm5"
    assert "not an absolute path" in problems(data)["roles.decode.args.model-weights-dir"]


def test_glm5_2_profile_is_not_converted_by_the_agent() -> None:
    data = b200(source="/hf")
    data["roles"]["decode"]["args"]["model"] = "glm5_2"
    found = problems(data)
    assert "glm_5_2_rocm" in found["roles.decode.convert"], found


def test_convert_belongs_to_the_decode_and_budgets_are_positive() -> None:
    data = b200()
    data["roles"]["prefill"]["convert"] = {"source": "/hf"}
    data["agent"] = {"convert_budget_s": 0, "convert_lock_stale_s": -1}
    found = problems(data)
    assert "roles.prefill.convert" in found
    assert "agent.convert_budget_s" in found
    assert "agent.convert_lock_stale_s" in found


def test_convert_job_plan() -> None:
    plan = convert_job_plan(make_plan(load(b200(source="/hf")), mock=False))
    assert (plan.prefill.nodes, plan.decode.nodes, plan.decode.first_node) == (0, 1, 0)
    assert plan.slurm.nodes == 1
    assert plan.slurm.gpus_per_node == 0
    assert plan.name.endswith("-convert")
    assert not isinstance(plan.convert, msgspec.UnsetType)
    assert plan.convert.only
    with pytest.raises(InputError) as info:
        convert_job_plan(make_plan(load(b200()), mock=False))
    assert info.value.problems[0].path == "roles.decode.convert"


# ---- the folder check ---------------------------------------------------------------------


def test_complete_folder(converted: Path) -> None:
    found = inspect(converted)
    assert found.complete, found.problems
    assert found.shard_count == 4
    assert found.marker is not None
    assert found.marker.index_sha256 == sha256_file(converted / "model.safetensors.index.json")


def test_without_marker_is_incomplete_even_with_every_shard(converted: Path) -> None:
    (converted / MARKER_NAME).unlink()
    found = inspect(converted)
    assert not found.complete
    assert found.shards_complete
    assert MARKER_NAME in found.summary()


def test_missing_and_cut_shards_are_named(converted: Path) -> None:
    shards = sorted(converted.glob("model.safetensors-*"))
    shards[0].unlink()
    with open(shards[1], "r+b") as f:
        f.truncate(100)
    found = inspect(converted)
    assert not found.complete
    assert not found.shards_complete
    assert f"{shards[0].name} is missing" in found.summary()
    assert f"{shards[1].name} is " in found.summary()


def test_index_changed_after_the_marker(converted: Path) -> None:
    index = converted / "model.safetensors.index.json"
    index.write_text(index.read_text() + " ")
    assert "SHA-256 differs" in inspect(converted).summary()


def test_replace_folder_keeps_old_or_new(tmp_path: Path, converted: Path) -> None:
    old = tmp_path / "old"
    (old / "model.safetensors-00001-of-00009.safetensors").parent.mkdir()
    (old / "model.safetensors-00001-of-00009.safetensors").write_bytes(b"x")
    replace_folder(converted, old, tmp_path / "aside")
    assert inspect(old).complete
    assert not converted.exists()
    assert not (tmp_path / "aside").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    replace_folder(old, empty, tmp_path / "aside")
    assert inspect(empty).complete


def test_foreign_entries_are_reported(converted: Path) -> None:
    (converted / "notes.txt").write_text("mine")
    assert inspect(converted).foreign == ["notes.txt"]


# ---- where the folder is on the node -------------------------------------------------------


def test_weights_paths_through_pyxis_mounts() -> None:
    mounts = ["/shared/w:/tilert_weights", "/shared/models:/models:ro"]
    paths = weights_paths("/tilert_weights/glm5", mounts, "pyxis")
    assert paths.host == Path("/shared/w/glm5")
    assert paths.siblings_visible
    assert paths.engine_path(Path("/shared/w/.glm5.tilert-converting-1")) == (
        "/tilert_weights/.glm5.tilert-converting-1"
    )
    itself = weights_paths("/tilert_weights", mounts, "pyxis")
    assert itself.host == Path("/shared/w")
    assert not itself.siblings_visible
    assert weights_paths("/x/y", [], "process").host == Path("/x/y")
    with pytest.raises(WeightsError, match="not under any"):
        weights_paths("/elsewhere/glm5", mounts, "pyxis")


# ---- the stand-in converter -----------------------------------------------------------------


def test_standin_writes_like_the_converter(tmp_path: Path) -> None:
    save = tmp_path / "out"
    done = convert(save, checkpoint(tmp_path / "hf"), env={"TILERT_MOCK_CONVERT_SHARDS": "3"})
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in save.iterdir())
    assert names == [
        "model.safetensors-00001-of-00003.safetensors",
        "model.safetensors-00002-of-00003.safetensors",
        "model.safetensors-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    found = inspect(save, marker_required=False)
    assert found.shards_complete
    assert found.shard_count == 3


def test_standin_refuses_what_the_converter_refuses(tmp_path: Path) -> None:
    done = convert(tmp_path / "out", tmp_path / "nothing")
    assert done.returncode == 1
    assert "Model directory" in done.stderr
    argv = [*CONVERTER, "--model_type", "glm5", "--model_dir", "x", "--save_dir", "y"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Invalid model type: glm5" in done.stderr


def test_standin_append_mtp(converted: Path, tmp_path: Path) -> None:
    before = inspect(converted, marker_required=False).shard_count
    done = convert(converted, tmp_path / "hf", "--append_mtp")
    assert done.returncode == 0, done.stderr
    after = inspect(converted, marker_required=False)
    assert after.shards_complete
    assert after.shard_count == before + 1
    assert (converted / "model_mtp_layer61-00001.safetensors").is_file()
    assert "SHA-256 differs" in inspect(converted).summary()  # the marker no longer holds


def test_standin_crash_half_way_leaves_no_index(tmp_path: Path) -> None:
    save = tmp_path / "out"
    env = {"TILERT_MOCK_CONVERT_CRASH_AFTER_SHARDS": "2"}
    done = convert(save, checkpoint(tmp_path / "hf"), env=env)
    assert done.returncode == 1, done.stderr
    assert len(list(save.glob("*.safetensors"))) == 2
    assert not (save / "model.safetensors.index.json").exists()


def test_standin_small_disk_fails_with_enospc(tmp_path: Path) -> None:
    save = tmp_path / "out"
    env = {"TILERT_MOCK_CONVERT_DISK_BYTES": "100000"}
    done = convert(save, checkpoint(tmp_path / "hf"), env=env)
    assert done.returncode == 1
    assert "No space left on device" in done.stderr
    assert sum(p.stat().st_size for p in save.iterdir()) == 100000


def test_standin_fault_target(tmp_path: Path) -> None:
    env = {
        "TILERT_MOCK_CONVERT_CRASH_AFTER_SHARDS": "1",
        "TILERT_MOCK_FAULT_TARGET": "decode-1",
        "TILERT_AGENT_NAME": "decode-0",
    }
    done = convert(tmp_path / "out", checkpoint(tmp_path / "hf"), env=env)
    assert done.returncode == 0, done.stderr


# ---- logs ------------------------------------------------------------------------------------


def test_convert_log_is_a_log_source(tmp_path: Path) -> None:
    job = JobDir(tmp_path)
    (tmp_path / "logs" / "decode-0").mkdir(parents=True)
    (tmp_path / "logs" / "decode-1").mkdir(parents=True)
    (tmp_path / "logs" / "decode-0" / "convert.log").write_text("x\n")
    files = log_files(job)
    assert files["decode-0:convert"] == tmp_path / "logs" / "decode-0" / "convert.log"
    assert "decode-1:convert" not in files
    assert log_path(job, "decode-0:convert") == files["decode-0:convert"]
    assert "decode-0:convert" not in log_files(job, agent=True)


# ---- tilert-submit convert: the plan printout, the batch script ------------------------------

DEMO = Path(__file__).resolve().parent.parent / "recipes" / "local-demo.yaml"


def test_submit_convert_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from submit.cli import main

    root = tmp_path / "job"
    sets = [
        "--set",
        f"roles.decode.args.model-weights-dir={tmp_path / 'w'}",
        "--set",
        f"roles.decode.convert={{source: {tmp_path / 'hf'}}}",
    ]
    assert main(["convert", str(DEMO), "--dry-run", "--mock", "--job-dir", str(root), *sets]) == 0
    out = capsys.readouterr().out
    assert "Convert job local-demo-convert" in out
    assert "--model_type glm-5" in out
    assert "agent.standins.converter" in out
    plan = load_plan((root / "plan.json").read_bytes())
    assert plan.prefill.nodes == 0
    assert plan.decode.nodes == 1
    assert [a["name"] for a in json.loads((root / "status.json").read_text())["agents"]] == [
        "decode-0"
    ]
    script = (root / "sbatch.sh").read_text()
    assert script.count("\nsrun ") == 1
    assert "--role decode" in script
    assert "#SBATCH --nodes=1" in script
    assert "--gpus-per-node" not in script
    assert "--gres" not in script
    assert subprocess.run(["bash", "-n", str(root / "sbatch.sh")], check=False).returncode == 0


def test_submit_convert_needs_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from submit.cli import main

    assert main(["convert", str(DEMO), "--dry-run", "--job-dir", str(tmp_path / "j")]) == 2
    assert "roles.decode.convert" in capsys.readouterr().err


def test_serving_dry_run_shows_the_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from submit.cli import main

    sets = [
        "--set",
        f"roles.decode.args.model-weights-dir={tmp_path / 'w'}",
        "--set",
        f"roles.decode.convert={{source: {tmp_path / 'hf'}}}",
    ]
    assert main([str(DEMO), "--dry-run", "--mock", "--job-dir", str(tmp_path / "j"), *sets]) == 0
    out = capsys.readouterr().out
    assert "Weights (checked on each decode node" in out
    assert "agent.convert_budget_s" in out


# ---- the gate in process: profiles the agent does not check ----------------------------------


async def test_glm5_2_weights_are_not_checked(tmp_path: Path) -> None:
    import logging

    from agent.job.paths import JobDir as Job
    from agent.launch import LaunchSpec, ProcessLauncher
    from agent.node.conversion import WeightsGate
    from agent.node.identity import Identity

    loaded = load(b200())
    plan = make_plan(loaded, mock=True)
    args = [*plan.decode.args]
    args[args.index("--model") + 1] = "glm5_2"
    # The gate reads the plan's model profile, never the argv back.
    decode = msgspec.structs.replace(plan.decode, args=args, model_profile="glm5_2")
    plan = msgspec.structs.replace(plan, decode=decode)
    gate = WeightsGate(
        plan=plan,
        job=Job(tmp_path),
        identity=Identity("decode", 0, "n", "127.0.0.1", None),
        launcher=ProcessLauncher(),
        launch_spec=lambda name, argv, env, _image: LaunchSpec(name=name, argv=argv, env=env),
        log=logging.getLogger("test"),
        on_change=lambda: None,
    )
    assert await gate.ready()  # /tilert_weights/... does not exist here: it was not looked at
    assert gate.status() is None
    assert gate.failure is None


# ---- the head: a converting worker is not late -----------------------------------------------


def test_a_converting_worker_is_not_late_and_not_healthy() -> None:
    from agent.head.decisions import JobView, converting, gate, waiting_for
    from agent.job.records import JobAgent
    from agent.job.vocab import AgentState, as_role

    def row(name: str, state: AgentState) -> JobAgent:
        role, _, index = name.rpartition("-")
        return JobAgent(
            name=name,
            role=as_role(role),
            index=int(index),
            node="n",
            state=state,
            restarts=0,
            reason="r",
            log="l",
            metrics_url=None,
            status_url=None,
        )

    busy = JobView(
        agents={"prefill-0": row("prefill-0", "healthy"), "decode-0": row("decode-0", "converting")}
    )
    assert converting(busy)
    assert gate(busy, now=1.0) is None
    assert "decode-0 (converting)" in waiting_for(busy)
    done = JobView(
        agents={"prefill-0": row("prefill-0", "healthy"), "decode-0": row("decode-0", "starting")}
    )
    assert not converting(done)
