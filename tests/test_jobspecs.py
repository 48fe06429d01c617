"""agent.launch.jobspecs: every process's LaunchSpec from the plan (mounts, container env, the
setup script once the preflight found it)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from agent.job.plan import load_plan
from agent.launch.jobspecs import JobSpecs
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
