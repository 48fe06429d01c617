"""The recipes TileRT users hold today (tests/data/recipes/wild/, public files unchanged) and
variants of them: srtctl 2.x examples and the InferenceX fork's schema 1 (``backend.type:
tilert``) load, plan what the fork's adapter runs, render a script shellcheck accepts, migrate to
a schema 2 with the same plan, are refused in their own keys and lines when wrong, and run as
``--local --mock`` jobs to ``ready`` with the conversion done once (docs/recipe.md)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.problems import InputError
from agent.recipe.cluster import load_cluster
from agent.recipe.loader import load_recipe
from agent.recipe.migrate import migrate_text
from agent.recipe.planner import make_plan
from submit.slurm.render import render_sbatch
from tests import kit
from tests.conftest import require

WILD = Path(__file__).parent / "data" / "recipes" / "wild"
SCHEMA1 = WILD / "inferencex-fixed-seq-len-1p1d-tp8-mtp.yaml"
B200 = WILD / "srtctl2-glm5-disagg.yaml"
ROCM = WILD / "srtctl2-glm5-rocm-mooncake-disagg.yaml"
NVIDIA_SITE = WILD / "srtslurm.yaml"
AMD_SITE = WILD / "srtslurm-amd.yaml"
HUB_ID = "zai-org/GLM-5.1-FP8"
DEMO_MODEL = kit.REPO / "recipes" / "local-demo-model"
SHELLCHECK = shutil.which("shellcheck")
READY_S = 90.0  # 2 shared cores; the real router imports transformers


def edited(text: str, *changes: tuple[str, str]) -> str:
    """``text`` with each (old, new) replaced once; every old must be there."""
    for old, new in changes:
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def mtp_off(text: str) -> str:
    return edited(text, ("  with_mtp: true\n  speculative_tokens: 1\n", "  with_mtp: false\n"))


def two_decodes(text: str) -> str:
    return edited(
        text,
        ("  decode_nodes: 1\n", "  decode_nodes: 2\n"),
        ("decode_workers: 1", "decode_workers: 2"),
    )


def rocm_values(text: str) -> str:
    """The fork's recipe with the MI355X image's values (GLM-5.3, bf16 KV, Mooncake, MTP 3)."""
    return edited(
        text,
        ('gpu_type: "b200"', 'gpu_type: "mi355x"'),
        ('  model_profile: "glm5"\n  weight_model_type: "glm-5"\n', '  model_profile: "glm5_2"\n'),
        ("  max_seq_len: 202752", "  max_seq_len: 1048576"),
        ('  kv_cache_dtype: "fp8"', '  kv_cache_dtype: "bf16"'),
        ('prefill_kv_cache_dtype: "fp8_ds_mla"', 'prefill_kv_cache_dtype: "bfloat16"'),
        ("  transport: nixl", "  transport: mooncake"),
        (
            "      gpu-memory-utilization: 0.75\n",
            "      gpu-memory-utilization: 0.85\n      block-size: 64\n    decode:\n"
            "      num-mtp: 3\n",
        ),
    )


@dataclass(frozen=True)
class Case:
    """One recipe: a real file, or a variant made from one; the cluster file it is used with."""

    base: Path
    site: Path
    make: Callable[[str], str] | None = None
    schema1: bool = True
    # Converted by the agent (not a glm5_2 profile, whose weights come from its own converter).
    converts: bool = True

    def write(self, folder: Path, name: str) -> Path:
        """The recipe as a file (a variant is written beside nothing else it needs)."""
        if self.make is None:
            return self.base
        path = folder / f"{name}.yaml"
        path.write_text(self.make(self.base.read_text()))
        return path


CASES = {
    "inferencex": Case(SCHEMA1, NVIDIA_SITE),
    "inferencex-mtp-off": Case(SCHEMA1, NVIDIA_SITE, mtp_off),
    "inferencex-2-decodes": Case(SCHEMA1, NVIDIA_SITE, two_decodes),
    "inferencex-rocm": Case(SCHEMA1, AMD_SITE, rocm_values, converts=False),
    "srtctl2-b200": Case(B200, NVIDIA_SITE, schema1=False, converts=False),
    "srtctl2-rocm": Case(ROCM, AMD_SITE, schema1=False, converts=False),
}
# More schema-1 shapes for migrate: the later fork's engine: spelling, and a commented file.
MIGRATED = {
    **{name: case for name, case in CASES.items() if case.schema1},
    "inferencex-engine": Case(
        SCHEMA1, NVIDIA_SITE, lambda t: edited(t, ("\nbackend:\n", "\nengine:\n"))
    ),
    "inferencex-commented": Case(
        SCHEMA1,
        NVIDIA_SITE,
        lambda t: "# a B200 point\n" + edited(t, ("  with_mtp: true", "  with_mtp: true  # MTP")),
    ),
}


def plan_of(path: Path, site: Path, **kw: object) -> Plan:
    return make_plan(load_recipe(path, cluster=load_cluster(site), **kw))  # type: ignore[arg-type]


def plan_json(plan: Plan) -> bytes:
    return msgspec.json.format(msgspec.json.encode(plan))


# ---- load and plan ----------------------------------------------------------------------------


def test_the_inferencex_recipe_plans_what_the_forks_adapter_runs() -> None:
    """Every key of the fork's recipe, in the argv and env srtctl's TileRT backend builds
    (docs/recipe.md, "recipes from srtctl 2.x and InferenceX")."""
    loaded = load_recipe(SCHEMA1, cluster=load_cluster(NVIDIA_SITE))
    plan = make_plan(loaded)
    transfer = {
        "kv_connector": "TileRTConnector",
        "kv_connector_module_path": "tilert.pd_vllm.prefill_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "tilert_model": "glm5",
            "tilert_max_seq_len": 202752,
            "tilert_transport": "nixl",
        },
    }
    assert plan.prefill.program[-1] == HUB_ID
    assert plan.prefill.args == [
        *("--served-model-name", HUB_ID, "--tensor-parallel-size", "8"),
        *("--max-model-len", "202752", "--return-tokens-as-token-ids"),
        *("--kv-cache-dtype", "fp8_ds_mla"),
        *("--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))),
        *("--speculative-config", '{"method":"mtp","num_speculative_tokens":1}'),
        *("--enforce-eager", "--trust-remote-code", "--gpu-memory-utilization", "0.75"),
    ]
    weights = "/data/home/sa-shared/gharunners/tilert-cache/glm5.1-fp8-8shard"
    assert plan.decode.args == [
        *("--model", "glm5", "--model-weights-dir", weights, "--max-seq-len", "202752"),
        *("--kv-cache-dtype", "fp8", "--transport", "nixl", "--with-mtp"),
    ]
    common = {
        "HF_HOME": "/hf_hub_cache",
        "HF_HUB_CACHE": "/hf_hub_cache/hub",
        "HUGGINGFACE_HUB_CACHE": "/hf_hub_cache/hub",
        "PYTHONUNBUFFERED": "1",
        "UCX_MEMTYPE_CACHE": "n",
        "UCX_MEMTYPE_REG_WHOLE": "n",
    }
    assert plan.prefill.env == {**common, "TILERT_ROLE": "prefill"}
    assert plan.decode.env == {**common, "TILERT_ROLE": "decode"}
    assert plan.router.env == {"TILERT_ROLE": "router"}
    assert plan.router.args == ["--parser", "none", "--queue-timeout", "0", "--model-path", HUB_ID]
    assert plan.prefill.image == "/images/tilert-prefill-0.1.6.sqsh"
    assert plan.decode.image == plan.router.image == "/images/tilert-decode-0.1.6.sqsh"
    assert (plan.prefill.nodes, plan.decode.nodes, plan.decode.gpus_per_worker) == (1, 1, 8)
    assert not isinstance(plan.convert, msgspec.UnsetType)
    assert (plan.convert.source, plan.convert.model_type) == (HUB_ID, "glm-5")
    assert plan.frameworks == {"tilert": "0.1.5.post3", "vllm": "0.26.0", "nixl": "1.3.1"}
    assert plan.pyxis_flags == ["--container-writable", "--container-remap-root"]
    assert plan.setup_script == "tilert_setup.sh"
    assert plan.slurm.time_limit == "04:00:00"
    assert plan.decode.startup_budget_s == 720 * 5
    assert not isinstance(plan.benchmark, msgspec.UnsetType)
    assert plan.benchmark.env["HF_HUB_CACHE"] == "/hf_hub_cache/hub"
    # What cannot be compared is said, never silently dropped.
    assert {w.path for w in loaded.warnings} >= {"identity.model", "identity.container"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_recipe_loads_plans_and_renders_a_script_shellcheck_accepts(
    name: str, tmp_path: Path
) -> None:
    case = CASES[name]
    plan = plan_of(case.write(tmp_path, name), case.site)
    assert isinstance(plan.convert, msgspec.UnsetType) != case.converts
    if "2-decodes" in name:
        assert (plan.decode.nodes, plan.decode.workers) == (2, 2)
    if "rocm" in name:
        assert plan.visible_devices_env == "ROCR_VISIBLE_DEVICES"
        assert "bf16" in plan.decode.args
        assert "mooncake" in plan.decode.args
        assert plan.decode.args[plan.decode.args.index("--num-mtp") + 1] == "3"
    if "mtp-off" in name:
        assert "--with-mtp" not in plan.decode.args
        assert "--speculative-config" not in plan.prefill.args
    script = tmp_path / "sbatch.sh"
    script.write_text(render_sbatch(plan, JobDir(tmp_path / "J"), ["tilert-agent"]))
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    require(SHELLCHECK is not None, "shellcheck is not installed")
    assert SHELLCHECK is not None
    done = subprocess.run([SHELLCHECK, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# ---- migrate -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MIGRATED))
def test_each_schema1_recipe_migrates_to_a_schema2_with_the_same_plan(
    name: str, tmp_path: Path
) -> None:
    case = MIGRATED[name]
    source = case.write(tmp_path, name)
    migrated = tmp_path / "migrated.yaml"
    done = kit.submit_cmd("migrate", str(source), "--cluster", str(case.site), "-o", str(migrated))
    assert done.returncode == 0, done.stderr
    assert "schema: 2\n" in migrated.read_text()
    assert "backend:" not in migrated.read_text()
    assert plan_json(plan_of(migrated, case.site)) == plan_json(plan_of(source, case.site))


def test_migrate_keeps_the_comments_beside_the_keys_they_describe() -> None:
    text = edited(
        SCHEMA1.read_text(),
        ("  weights_dir:", "  # converted once by the first decode\n  weights_dir:"),
        ("  max_seq_len: 202752", "  max_seq_len: 202752  # GLM-5.1's context"),
        ("dynamo:\n", "# no Dynamo wheel in these images\ndynamo:\n"),
    )
    out = migrate_text("# InferenceX B200 point\n\n" + text, "x.yaml").splitlines()
    assert "# InferenceX B200 point" in out[:6]
    weights = next(i for i, line in enumerate(out) if "model-weights-dir:" in line)
    assert out[weights - 1] == "      # converted once by the first decode"
    # A key that became several schema-2 keys: its comment goes above the first of them.
    assert "# GLM-5.1's context" in "\n".join(out)
    assert "# (dynamo) no Dynamo wheel in these images" in out


def test_migrate_refuses_what_is_not_schema1_and_what_cannot_be_kept(tmp_path: Path) -> None:
    done = kit.submit_cmd("migrate", str(B200), "--cluster", str(NVIDIA_SITE))
    assert done.returncode == 2
    assert "not a srtctl schema-1 TileRT recipe" in done.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(edited(SCHEMA1.read_text(), ("  install: false", "  install: true")))
    done = kit.submit_cmd(
        "migrate", str(bad), "--cluster", str(NVIDIA_SITE), "-o", str(tmp_path / "o")
    )
    assert done.returncode == 2
    line = bad.read_text().splitlines().index("dynamo:") + 1
    assert f"bad.yaml:{line}: dynamo: tilert-agent runs no Dynamo" in done.stderr
    assert not (tmp_path / "o").exists()


def test_migrate_without_the_sites_cluster_file_writes_and_says_what_loading_finds(
    tmp_path: Path,
) -> None:
    """Migration is about keys: image aliases the site defines do not stop it; what a dry run
    here would refuse is said on stderr, the schema-2 file inheriting it."""
    out = tmp_path / "out.yaml"
    done = kit.submit_cmd("migrate", str(SCHEMA1), "-o", str(out), env=kit.clean_env())
    assert done.returncode == 0, done.stderr
    assert "migrated as it is; loading it here finds" in done.stderr
    assert "model.container: 'tilert-decode' is neither a cluster image alias" in done.stderr
    assert plan_json(plan_of(out, NVIDIA_SITE)) == plan_json(plan_of(SCHEMA1, NVIDIA_SITE))


def migrate_to(output: Path | str, *flags: str) -> subprocess.CompletedProcess[str]:
    """``tilert-submit migrate SCHEMA1 -o OUTPUT [FLAGS]`` with the site's cluster file."""
    return kit.submit_cmd(
        "migrate", str(SCHEMA1), "--cluster", str(NVIDIA_SITE), "-o", str(output), *flags
    )


def test_migrate_writes_a_new_regular_file_or_stdout_never_through_a_link_or_fifo(
    tmp_path: Path,
) -> None:
    """``-o`` is judged with lstat (docs/cli.md): a FIFO, a symbolic link (dangling or not) and a
    folder are refused, exit 2, naming ``-o`` and what to do, and left as they were."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = tmp_path / "kept.yaml"
    target.write_text("mine\n")
    link, dangling = tmp_path / "link.yaml", tmp_path / "dangling.yaml"
    link.symlink_to(target)
    dangling.symlink_to(tmp_path / "nowhere.yaml")
    for output, kind in (
        (fifo, "a FIFO"),
        (link, "a symbolic link"),
        (dangling, "a symbolic link"),
        (tmp_path, "a folder"),
    ):
        done = migrate_to(output)
        assert done.returncode == 2, (output, done.stdout, done.stderr)
        assert f"-o {output}: exists and is {kind}" in done.stderr, done.stderr
        assert "not a regular file; pass another FILE" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert link.is_symlink()
    assert dangling.is_symlink()
    assert target.read_text() == "mine\n"
    assert not (tmp_path / "nowhere.yaml").exists()
    # Standard output with -o -, nothing written.
    done = migrate_to("-")
    assert done.returncode == 0, done.stderr
    assert "schema: 2\n" in done.stdout


def test_migrate_replaces_an_existing_file_only_with_force_and_atomically(tmp_path: Path) -> None:
    out = tmp_path / "out.yaml"
    out.write_text("mine\n")
    done = migrate_to(out)
    assert done.returncode == 2
    assert f"-o {out}: exists; pass --force to replace it, or another FILE" in done.stderr
    assert out.read_text() == "mine\n"
    # A reader holding the old file keeps reading the old content: a new file was renamed over it.
    old = tmp_path / "old-link"
    os.link(out, old)
    done = migrate_to(out, "--force")
    assert done.returncode == 0, done.stderr
    assert "schema: 2\n" in out.read_text()
    assert old.read_text() == "mine\n"
    assert os.stat(out).st_ino != os.stat(old).st_ino
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left


# ---- refused, in the user's own keys and lines -------------------------------------------------

BAD = [
    # (what is changed, the key named, words of the message)
    (('  kv_cache_dtype: "fp8"', '  kv_cache_dtype: "bf16"'), "backend.kv_cache_dtype", "layout"),
    (("  transport: nixl", "  transport: tcp"), "backend.transport", "unknown transport"),
    (('  model_profile: "glm5"', '  model_profile: "glm9"'), "backend.model_profile", "profile"),
    (
        ('  weight_model_type: "glm-5"', '  weight_model_type: "deepseek-v32"'),
        "backend.weight_model_type",
        "does not match the decode model profile",
    ),
    (("  max_seq_len: 202752", "  max_seq_len: -5"), "backend.max_seq_len", "positive integer"),
    (("  with_mtp: true", '  with_mtp: "yes"'), "backend.with_mtp", "true or false"),
    (("  speculative_tokens: 1", "  speculative_tokens: 0"), "backend.speculative_tokens", "1 to"),
    (("  with_mtp: true", "  with_mtp: false"), "backend.speculative_tokens", "with_mtp: false"),
    (
        ("      enforce-eager: true", "      max-model-len: 1000"),
        "backend.tilert_config.prefill.max-model-len",
        "managed by srtctl schema 1",
    ),
    (
        ("      enforce-eager: true", "      port: 9000"),
        "backend.tilert_config.prefill.port",
        "managed by srtctl schema 1",
    ),
    (('  container-writable: ""', '  cpu-bind: "none"'), "srun_options.cpu-bind", "pyxis"),
    (("  install: false", "  install: true"), "dynamo", "runs no Dynamo"),
    (("  decode_nodes: 1\n", "  decode_nodes: 0\n"), "resources.decode_nodes", ""),
    (("    queue-timeout: 0", "    model-path: /m"), "frontend.args.model-path", "model.path"),
    (('  gpu_type: "b200"', '  gpu_type: "mi355x"'), "resources.gpu_type", "ROCR_VISIBLE_DEVICES"),
    (
        ("srun_options:", "container_mounts: ['/a:relative']\nsrun_options:"),
        "container_mounts[0]",
        "not an absolute path",
    ),
    (("  prefill_container:", "  prefill_image:"), "backend.prefill_image", "unknown key"),
]


@pytest.mark.parametrize(("change", "key", "words"), BAD, ids=[b[1] for b in BAD])
def test_a_bad_schema1_recipe_is_refused_naming_its_own_key_and_line(
    change: tuple[str, str], key: str, words: str, tmp_path: Path
) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(edited(SCHEMA1.read_text(), change))
    with pytest.raises(InputError) as info:
        load_recipe(recipe, cluster=load_cluster(NVIDIA_SITE))
    errors = [p for p in info.value.problems if p.severity == "error"]
    mine = [p for p in errors if p.path == key]
    assert mine, [(p.path, p.message) for p in errors]
    assert words in mine[0].message, mine[0]
    # The line of the key itself (its last part), as the user wrote it.
    last = key.split(".")[-1].split("[")[0] + ":"
    lines = recipe.read_text().splitlines()
    wanted = next(i for i, text in enumerate(lines, 1) if text.strip().startswith(last))
    assert mine[0].line == wanted, (mine[0], wanted)
    # Every problem is named in schema 1's keys (a hint may give the schema-2 spelling).
    assert not [p.path for p in errors if p.path.startswith(("roles.", "agent."))]


def test_dry_run_of_a_schema1_recipe_exits_0_and_prints_the_plan(tmp_path: Path) -> None:
    job = tmp_path / "J"
    done = kit.submit_cmd(
        str(SCHEMA1), "--dry-run", "--cluster", str(NVIDIA_SITE), "--job-dir", str(job)
    )
    assert done.returncode == 0, done.stderr
    assert "--kv-transfer-config" in done.stdout
    assert "Dry run: nothing submitted." in done.stdout
    written = msgspec.json.decode((job / "plan.json").read_bytes(), type=Plan)
    assert plan_json(written) == plan_json(plan_of(SCHEMA1, NVIDIA_SITE))


# ---- --local --mock to ready ---------------------------------------------------------------------


def local_site(tmp_path: Path) -> Path:
    """A cluster file for this machine: the recipes' model names mapped to a checkpoint folder
    the converter stand-in and the real router read (the demo tokenizer, an index, a config)."""
    checkpoint = tmp_path / "hf"
    shutil.copytree(DEMO_MODEL, checkpoint)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "m-1.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    (checkpoint / "config.json").write_text("{}")
    site = tmp_path / "srtslurm.yaml"
    names = [f"hf:{HUB_ID}", HUB_ID, "glm5.3"]
    site.write_text(
        "network_interface: lo\nlauncher: process\nvisible_devices_env: ROCR_VISIBLE_DEVICES\n"
        "model_paths:\n" + "".join(f'  "{name}": {checkpoint}\n' for name in names)
    )
    return site


def local_sets(name: str, weights: Path) -> list[str]:
    """What a local run changes: the weights folder (a temp one), no benchmark."""
    sets = ["benchmark={type: manual}"]
    if CASES[name].schema1:
        return [*sets, f"backend.weights_dir={weights}"]
    sets.append(f"roles.decode.args.model-weights-dir={weights}")
    if name == "srtctl2-rocm":
        return [*sets, "frontend.args.model-path=glm5.3"]  # /model is srtctl's container mount
    return [*sets, f"roles.decode.convert={{source: hf:{HUB_ID}}}"]


@pytest.mark.router
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_recipe_runs_as_a_local_mock_job_to_ready(
    name: str, tmp_path: Path, router_python: Path
) -> None:
    case = CASES[name]
    recipe = case.write(tmp_path, name)
    weights = tmp_path / "weights" / "glm5"
    extra = [arg for item in local_sets(name, weights) for arg in ("--set", item)]
    sets, _ = kit.isolated_sets(router_python)
    site = local_site(tmp_path)
    args = [*sets, *extra, "--cluster", str(site)]
    converts = case.converts or name == "srtctl2-b200"
    with kit.LocalJob(tmp_path / "job", args, recipe=recipe) as job:
        status = job.wait_state("ready", timeout=READY_S)
        decodes = [a for a in status["agents"] if a["role"] == "decode"]
        assert len(decodes) == (2 if "2-decodes" in name else 1)
        runs = [
            line
            for log in sorted((job.job / "logs").glob("*/convert.log"))
            for line in log.read_text(errors="replace").splitlines()
            if line.startswith("=== converter pid") and "ended" not in line
        ]
        assert len(runs) == (1 if converts else 0), runs
        if converts:
            assert (weights / ".tilert-converted.json").is_file()
        code, left = job.stop(timeout=60)
        assert code == 0, job.output()
        assert left == []


def test_the_rocm_decode_flags_must_agree_with_its_prefill(tmp_path: Path) -> None:
    """ROCm values, each broken in turn: the KV pair (bfloat16 / bf16), num-mtp without MTP,
    and the AMD GPU on a site that pins GPUs with CUDA's variable; named in schema 1's keys."""
    rocm = rocm_values(SCHEMA1.read_text())
    broken = {
        "backend.kv_cache_dtype": edited(rocm, ('kv_cache_dtype: "bf16"', 'kv_cache_dtype: "fp8"')),
        "backend.tilert_config.decode.num-mtp": mtp_off(rocm),
    }
    for key, text in broken.items():
        recipe = tmp_path / "rocm.yaml"
        recipe.write_text(text)
        with pytest.raises(InputError) as info:
            load_recipe(recipe, cluster=load_cluster(AMD_SITE))
        assert key in {p.path for p in info.value.problems if p.severity == "error"}, key
    recipe.write_text(rocm)
    with pytest.raises(InputError) as info:
        load_recipe(recipe, cluster=load_cluster(NVIDIA_SITE))
    (problem,) = [p for p in info.value.problems if p.path == "resources.gpu_type"]
    assert problem.hint == "set visible_devices_env: ROCR_VISIBLE_DEVICES in the cluster file"


def test_the_later_forks_engine_section_and_served_model_name(tmp_path: Path) -> None:
    """The fork later spells ``backend`` as ``engine`` and adds ``served_model_name``: the same
    job, and problems named ``engine.*``."""
    recipe = tmp_path / "engine.yaml"
    recipe.write_text(edited(SCHEMA1.read_text(), ("\nbackend:\n", "\nengine:\n")))
    assert plan_json(plan_of(recipe, NVIDIA_SITE)) == plan_json(plan_of(SCHEMA1, NVIDIA_SITE))
    named = edited(
        recipe.read_text(), ("  type: tilert\n", "  type: tilert\n  served_model_name: glm\n")
    )
    recipe.write_text(named)
    plan = plan_of(recipe, NVIDIA_SITE)
    assert plan.prefill.args[:2] == ["--served-model-name", "glm"]
    assert plan.model == "glm"
    recipe.write_text(edited(named, ('  kv_cache_dtype: "fp8"', '  kv_cache_dtype: "bf16"')))
    with pytest.raises(InputError) as info:
        load_recipe(recipe, cluster=load_cluster(NVIDIA_SITE))
    assert "engine.kv_cache_dtype" in {p.path for p in info.value.problems}
