"""agent.launch.jobspecs: every process's LaunchSpec from the plan (mounts, container env, the
setup script once the preflight found it)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from agent.job.plan import load_plan
from agent.launch.jobspecs import JobSpecs
from agent.launch.pyxis import pyxis_srun_argv
from tests.golden import GOLDEN_DIR


def test_pyxis_specs_mount_the_scratch_root_and_name_the_variables_that_must_win() -> None:
    plan = load_plan((GOLDEN_DIR / "b200-nixl-glm5.plan.json").read_bytes())
    assert plan.launcher == "pyxis"
    specs = JobSpecs(plan, scratch_root=Path("/tmp/tilert-abc"))
    env = {"CUDA_VISIBLE_DEVICES": "0", "TMPDIR": "/tmp/tilert-abc/x", "UNRELATED": "1"}
    spec = specs("decode-0", ["python", "-m", "m"], env, "img.sqsh")
    assert spec.mounts == (*plan.mounts, "/tmp/tilert-abc:/tmp/tilert-abc")
    # Ours (the GPU selector, the scratch variables) win over the image's; others are the image's.
    assert spec.container_env == ("CUDA_VISIBLE_DEVICES", "TMPDIR")
    assert (spec.image, spec.setup_script) == ("img.sqsh", None)
    specs.setup_script = Path("/configs/setup.sh")  # found by the engine's preflight
    assert specs("router", [], {}, None).setup_script == Path("/configs/setup.sh")


def test_process_specs_keep_the_job_mounts_only() -> None:
    plan = load_plan((GOLDEN_DIR / "b200-nixl-glm5.plan.json").read_bytes())
    plan = msgspec.structs.replace(plan, launcher="process")
    spec = JobSpecs(plan, scratch_root=Path("/tmp/tilert-abc"))("prefill-0", ["vllm"], {}, None)
    assert spec.mounts == tuple(plan.mounts)
    assert spec.container_env == ()


def test_the_recipes_pyxis_flags_reach_every_steps_srun_line() -> None:
    """agent.pyxis_flags (schema 1's srun_options) on each pyxis step, beside the image."""
    plan = load_plan((GOLDEN_DIR / "b200-nixl-glm5.plan.json").read_bytes())
    assert JobSpecs(plan, scratch_root=Path("/s"))("decode-0", [], {}, "i").container_flags == ()
    flags = ["--container-writable", "--container-remap-root"]
    plan = msgspec.structs.replace(plan, pyxis_flags=flags)
    spec = JobSpecs(plan, scratch_root=Path("/s"))("decode-0", ["python"], {}, "img.sqsh")
    argv = pyxis_srun_argv(spec, "42", "node1", "tilert-decode-0")
    assert argv[argv.index("--container-image=img.sqsh") :][4:6] == flags
    # Without an image there is no container to give them to.
    bare = JobSpecs(plan, scratch_root=Path("/s"))("decode-0", ["python"], {}, None)
    assert not set(flags) & set(pyxis_srun_argv(bare, "42", "node1", "tilert-decode-0"))
