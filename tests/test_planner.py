"""The planner: recipe + cluster -> Plan, pinned by golden snapshots of both reference recipes."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from agent.job.plan import load_plan
from agent.problems import InputError
from agent.recipe.cluster import ClusterConfig, load_cluster
from agent.recipe.loader import LoadedRecipe, load_recipe
from agent.recipe.planner import make_plan, render_args, secret_values, stop_graces
from tests.golden import GOLDEN_DIR, RECIPES, match

B200 = RECIPES / "b200-nixl-glm5.yaml"
MI355X = RECIPES / "mi355x-mooncake-glm5.yaml"
DEMO = RECIPES / "local-demo.yaml"
B200_CLUSTER = RECIPES / "srtslurm.example.yaml"
MI355X_CLUSTER = GOLDEN_DIR / "mi355x.cluster.yaml"


def load(
    path: Path, cluster: Path | ClusterConfig | None = None, overrides: list[str] | None = None
) -> LoadedRecipe:
    config = load_cluster(cluster) if isinstance(cluster, Path) else cluster
    return load_recipe(path, overrides=overrides or [], cluster=config)


def plan_json(loaded: LoadedRecipe, **kwargs: object) -> str:
    plan = make_plan(loaded, mock=False, **kwargs)  # type: ignore[arg-type]
    return msgspec.json.format(msgspec.json.encode(plan)).decode() + "\n"


# ---- render_args ------------------------------------------------------------------------------


def test_render_args_rules() -> None:
    args = {
        "tensor-parallel-size": 8,
        "enforce-eager": True,
        "disabled": False,
        "unset": None,
        "gpu_memory_utilization": 0.75,
        "kv-transfer-config": {"kv_connector": "TileRTConnector", "extra": {"n": 1, "on": True}},
        "decode": ["a:1:2", "b:3:4"],
        "empty": [],
        "--already-dashed": "x y",
    }
    assert render_args(args) == [
        "--tensor-parallel-size",
        "8",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.75",
        "--kv-transfer-config",
        '{"kv_connector":"TileRTConnector","extra":{"n":1,"on":true}}',
        "--decode",
        "a:1:2",
        "b:3:4",
        "--already-dashed",
        "x y",
    ]


def test_render_args_keeps_strings_verbatim() -> None:
    # A JSON string the user wrote is passed as written (vLLM parses it), never re-encoded.
    value = '{"method": "mtp",  "num_speculative_tokens": 1}'
    assert render_args({"speculative-config": value}) == ["--speculative-config", value]


# ---- golden plans -----------------------------------------------------------------------------


def test_b200_plan_golden() -> None:
    match("b200-nixl-glm5.plan.json", plan_json(load(B200, B200_CLUSTER)))


def test_mi355x_plan_golden() -> None:
    match("mi355x-mooncake-glm5.plan.json", plan_json(load(MI355X, MI355X_CLUSTER)))


def test_the_decode_plan_carries_its_profile_and_weights_folder() -> None:
    """What two decode flags mean is read once, into the plan: the profile (glm5 when the recipe
    leaves --model out) and the weights folder (None without one)."""
    mi355x = make_plan(load(MI355X, MI355X_CLUSTER)).decode
    assert (mi355x.model_profile, mi355x.weights_dir) == ("glm5_2", "/models/GLM-5.3-tilert-tp8")
    demo = make_plan(load(DEMO)).decode
    assert (demo.model_profile, demo.weights_dir) == ("glm5", None)
    bare = make_plan(load_recipe(DEMO, unsets=["roles.decode.args.model"])).decode
    assert "--model" not in bare.args
    assert bare.model_profile == "glm5"


def test_plan_is_deterministic_and_decodes() -> None:
    first = plan_json(load(B200, B200_CLUSTER))
    second = plan_json(load(B200, B200_CLUSTER))
    assert first == second
    plan = load_plan(first.encode())
    assert plan.name == "glm5-tilert-disagg"


def test_b200_commands_and_images() -> None:
    plan = make_plan(load(B200, B200_CLUSTER), mock=False)
    assert plan.prefill.program == ["vllm", "serve", "zai-org/GLM-5.1-FP8"]  # hf: stripped
    assert plan.decode.program == ["python", "-m", "tilert.pd_vllm.decode_server"]
    assert plan.router.program == ["python", "-m", "tilert.pd_vllm.pd_router"]
    # No agent-managed argument is in the plan: the agent adds them once ports are chosen.
    for argv in (plan.prefill.args, plan.decode.args, plan.router.args):
        assert not {"--host", "--port", "--engine", "--http-port", "--ctrl-port"} & set(argv)
        assert not {"--vllm-url", "--decode"} & set(argv)
    assert plan.prefill.image == "/shared/images/tilert-prefill-0.1.6.sqsh"
    assert plan.decode.image == "/shared/images/tilert-decode-0.1.6.sqsh"
    assert plan.router.image == "/shared/images/tilert-router-0.1.6.sqsh"
    assert plan.model == "zai-org/GLM-5.1-FP8"
    assert (plan.prefill.first_node, plan.decode.first_node) == (0, 1)
    assert plan.slurm.nodes == 2
    assert plan.slurm.gpus_per_node == 8
    assert plan.launcher == "pyxis"
    # srtctl's budget: health_check 720 x 5 s.
    assert plan.prefill.startup_budget_s == plan.decode.startup_budget_s == 3600.0
    assert plan.router.startup_budget_s == 300.0


def test_mi355x_router_uses_model_container_and_amd_gpus() -> None:
    plan = make_plan(load(MI355X, MI355X_CLUSTER), mock=False)
    assert plan.router.image == "ghcr.io/tile-ai/tilert-rocm-decode:0.1.6"
    assert plan.visible_devices_env == "ROCR_VISIBLE_DEVICES"
    assert plan.prefill.program[-1] == "/shared/models/GLM-5.3"
    assert "/shared/models/GLM-5.3" in plan.router.args
    assert plan.model == "glm5_2"
    assert plan.prefill.env == {
        "RDMAV_FORK_SAFE": "1",
        "VLLM_ROCM_USE_AITER": "1",
        "VLLM_ROCM_USE_AITER_MOE": "1",
        "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "1",
        "VLLM_ENGINE_READY_TIMEOUT_S": "10800",
    }
    assert plan.decode.env == {"RDMAV_FORK_SAFE": "1", "GLM5_AR_N": "2"}
    assert plan.prefill.startup_budget_s == 21600.0


# ---- env and secrets --------------------------------------------------------------------------


def test_env_layers_and_secrets_stay_out_of_the_plan() -> None:
    loaded = load(
        DEMO,
        overrides=[
            "environment.SHARED=top",
            "environment.HF_TOKEN=hf-secret-value",
            "roles.decode.env.SHARED=decode-wins",
            "roles.decode.env.FLAG=true",
            "frontend.env.ROUTER_API_KEY=router-secret-value",
        ],
    )
    plan = make_plan(loaded, mock=True)
    assert plan.prefill.env["SHARED"] == "top"
    assert plan.decode.env["SHARED"] == "decode-wins"
    assert plan.decode.env["FLAG"] == "1"  # YAML booleans as the rules compare them
    assert plan.prefill.secret_env == ["HF_TOKEN"]
    assert plan.router.secret_env == ["HF_TOKEN", "ROUTER_API_KEY"]
    text = msgspec.json.encode(plan).decode()
    assert "hf-secret-value" not in text
    assert "router-secret-value" not in text
    assert secret_values(loaded.recipe) == {
        "HF_TOKEN": "hf-secret-value",
        "ROUTER_API_KEY": "router-secret-value",
    }


def test_public_model_falls_back_to_model_path() -> None:
    loaded = load(DEMO, overrides=["roles.prefill.args.served-model-name="])
    plan = make_plan(loaded, mock=True)
    assert plan.model == str(RECIPES / "local-demo-model")
    assert "--served-model-name" not in plan.prefill.args


# ---- budgets, graces, launcher ----------------------------------------------------------------


def test_partial_agent_sections_keep_the_other_defaults() -> None:
    loaded = load(
        B200,
        B200_CLUSTER,
        overrides=["agent.startup_budget_s={decode: 7200}", "agent.stop_grace_s={decode: 10}"],
    )
    plan = make_plan(loaded, mock=False)
    assert plan.decode.startup_budget_s == 7200.0
    assert plan.prefill.startup_budget_s == 3600.0  # health_check budget
    assert plan.router.startup_budget_s == 300.0  # the agent section's default
    assert (plan.prefill.stop_grace_s, plan.decode.stop_grace_s, plan.router.stop_grace_s) == (
        20.0,
        10.0,
        5.0,
    )


def test_health_check_defaults_when_the_recipe_has_none() -> None:
    loaded = load(DEMO, overrides=["health_check={}", "agent.startup_budget_s={router: 9}"])
    plan = make_plan(loaded, mock=True)
    # recipe.DEFAULT_HEALTH_MAX_ATTEMPTS x DEFAULT_HEALTH_INTERVAL_S
    assert plan.prefill.startup_budget_s == 3600.0
    assert plan.router.startup_budget_s == 9.0


@pytest.mark.parametrize("kill_wait", [5.0, 12.0, 30.0, 1.0])
def test_graces_fit_in_kill_wait(kill_wait: float) -> None:
    recipe = load(
        B200,
        B200_CLUSTER,
        overrides=["agent.stop_grace_s={prefill: 40, decode: 40, router: 10}"],
    ).recipe
    graces = stop_graces(recipe, kill_wait)
    budget = max(kill_wait, 5.0)  # Slurm kills max(KillWait, 5) s after SIGTERM
    assert graces["prefill"] + graces["router"] < budget
    assert graces["decode"] < budget
    # Shrunk in proportion: the router keeps its share of the head agent's drain.
    assert graces["router"] == pytest.approx(graces["prefill"] / 4, rel=1e-2)


def test_graces_unchanged_when_they_fit() -> None:
    recipe = load(B200, B200_CLUSTER).recipe
    assert stop_graces(recipe, 30.0) == {"prefill": 20.0, "decode": 20.0, "router": 5.0}


def test_kill_wait_comes_from_the_cluster() -> None:
    site = load_cluster(B200_CLUSTER)
    short = msgspec.structs.replace(site, kill_wait_s=5.0)
    plan = make_plan(load(B200, short), mock=False)
    assert plan.slurm.kill_wait_s == 5.0
    assert plan.prefill.stop_grace_s + plan.router.stop_grace_s <= 3.0


def test_launcher_choice() -> None:
    pyxis = load(B200, B200_CLUSTER)
    assert make_plan(pyxis, mock=False).launcher == "pyxis"
    assert make_plan(pyxis, mock=False, launcher="process").launcher == "process"
    assert make_plan(pyxis, mock=True, launcher="pyxis").launcher == "process"  # mock forces it
    no_cluster = load(DEMO)
    assert make_plan(no_cluster, mock=False).launcher == "process"


def test_local_demo_plan() -> None:
    loaded = load(DEMO)
    assert loaded.warnings == []
    plan = make_plan(loaded, mock=True)
    assert plan.standins == ["prefill", "decode", "router"]
    assert (plan.prefill.nodes, plan.decode.nodes) == (1, 2)
    assert plan.slurm.nodes == 3
    assert plan.slurm.gpus_per_node == 0
    assert plan.prefill.gpus_per_worker == plan.decode.gpus_per_worker == 0
    assert plan.model == "demo-model"
    assert plan.prefill.program[-1] == str(RECIPES / "local-demo-model")
    kv = plan.prefill.args[plan.prefill.args.index("--kv-transfer-config") + 1]
    assert json.loads(kv)["kv_connector_extra_config"]["tilert_max_seq_len"] == 4096


def test_node_local_logs_in_the_plan() -> None:
    """agent.logs.location: node puts the folder in the plan; the default adds nothing to it."""
    assert "log_node_dir" not in plan_json(load(DEMO))
    loaded = load(DEMO, overrides=["agent.logs.location=node", "agent.logs.node_dir=/local/x"])
    plan = load_plan(plan_json(loaded).encode())
    assert plan.agent.log_node_dir == "/local/x"
    assert load_plan(plan_json(load(DEMO)).encode()).agent.log_node_dir is None


def test_a_cpu_only_cluster_takes_stand_ins_or_roles_that_say_gpus_0() -> None:
    cpu_only = ClusterConfig(gpus_per_node=0, launcher="process")
    demo = DEMO
    # The demo's roles say gpus: 0: real engines on CPUs are fine, and so are stand-ins.
    assert make_plan(load_recipe(demo, cluster=cpu_only)).slurm.gpus_per_node == 0
    unset = ["roles.prefill.gpus", "roles.decode.gpus"]
    loaded = load_recipe(demo, unsets=unset, cluster=cpu_only)
    assert make_plan(loaded, mock=True).decode.gpus_per_worker == 0
    # A real engine without a GPU count of its own is asked to say it.
    with pytest.raises(InputError) as info:
        make_plan(loaded, mock=["decode"])
    assert [p.path for p in info.value.problems] == ["roles.prefill.gpus"]
    assert "set roles.prefill.gpus: 0 to run it on CPUs" in str(info.value)
    assert "--mock prefill" in str(info.value)
