"""Recipe loading: syntax, shape, all problems together, resolution, and the resolved round trip."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

from agent.problems import InputError
from agent.recipe.cluster import ClusterConfig, load_cluster
from agent.recipe.loader import LoadedRecipe, load_recipe, load_recipe_text, resolved_yaml
from agent.recipe.model import public_model_name

DATA = Path(__file__).parent / "data" / "recipes"
B200 = DATA / "b200-nixl-glm5.yaml"
MI355X = DATA / "mi355x-mooncake-glm5.yaml"
CLUSTER = load_cluster(DATA / "srtslurm.yaml")
# The same site with AMD GPUs: ROCm's device variable (an AMD recipe needs it said).
AMD_CLUSTER = msgspec.structs.replace(CLUSTER, visible_devices_env="ROCR_VISIBLE_DEVICES")


def load_text(text: str, **kw: object) -> LoadedRecipe:
    kw.setdefault("cluster", CLUSTER)
    return load_recipe_text(text, source="t.yaml", base_dir=DATA, **kw)  # type: ignore[arg-type]


def fail_text(text: str, **kw: object) -> InputError:
    with pytest.raises(InputError) as info:
        load_text(text, **kw)
    return info.value


def b200_text() -> str:
    return B200.read_text()


def edit(old: str, new: str) -> str:
    text = b200_text()
    assert old in text
    return text.replace(old, new, 1)


# ---- the reference recipes ----------------------------------------------------------------------


def test_b200_loads_unchanged_with_the_cluster_aliases() -> None:
    loaded = load_recipe(B200, cluster=CLUSTER)
    r = loaded.recipe
    assert r.roles.prefill is not None
    assert r.roles.decode is not None
    assert r.roles.prefill.container == "/images/tilert-prefill-0.1.6.sqsh"
    assert r.roles.decode.container == "/images/tilert-decode-0.1.6.sqsh"
    assert r.frontend.container_image == "/images/tilert-router-0.1.6.sqsh"
    assert r.model.container == "/images/tilert-decode-0.1.6.sqsh"
    # hf: stripped to the hub id vLLM takes.
    assert r.model.path == "zai-org/GLM-5.1-FP8"
    assert public_model_name(r) == "zai-org/GLM-5.1-FP8"
    # Cluster defaults merged; the recipe keeps its own values.
    assert (r.slurm.account, r.slurm.partition, r.slurm.time_limit) == ("llm", "gpu", "04:00:00")
    assert r.resources.gpus_per_node == 8
    assert "/models:/models" in r.container_mounts
    assert loaded.source == str(B200)
    assert {w.path for w in loaded.warnings} == {"frontend.args.model-path", "model.path"}


def test_mi355x_loads_with_its_model_alias() -> None:
    loaded = load_recipe(MI355X, cluster=AMD_CLUSTER)
    r = loaded.recipe
    assert r.model.path == "/models/GLM-5.3"
    assert r.roles.prefill is not None
    assert r.roles.decode is not None
    assert r.roles.prefill.container == "ghcr.io/tile-ai/tilert-rocm-prefill:0.1.6"
    assert r.frontend.container_image is None  # the router runs in model.container
    assert r.environment == {"RDMAV_FORK_SAFE": "1"}
    assert r.roles.decode.env == {"GLM5_AR_N": "2"}
    assert r.health_check.max_attempts == 2160
    assert loaded.warnings == []


def test_an_amd_gpu_with_nvidias_device_variable_is_refused_naming_the_cluster_key() -> None:
    """mi355x on a cluster that selects GPUs with CUDA_VISIBLE_DEVICES (its default): told,
    not guessed; the recipe's gpu_type line, the cluster key and its value named."""
    with pytest.raises(InputError) as info:
        load_recipe(MI355X, cluster=CLUSTER)
    (problem,) = [p for p in info.value.problems if p.path == "resources.gpu_type"]
    assert "visible_devices_env is CUDA_VISIBLE_DEVICES" in problem.message
    assert problem.hint == "set visible_devices_env: ROCR_VISIBLE_DEVICES in the cluster file"
    assert problem.line == MI355X.read_text().splitlines().index("  gpu_type: mi355x") + 1
    # The agents' own re-check on the node (no cluster file there) does not repeat it.
    text = resolved_yaml(load_recipe(MI355X, cluster=AMD_CLUSTER))
    load_recipe_text(text, source="J/recipe.yaml", base_dir=DATA, on_submit_host=False)


def test_b200_without_a_cluster_file_names_every_alias() -> None:
    with pytest.raises(InputError) as info:
        load_recipe(B200, cluster=ClusterConfig())
    paths = {p.path for p in info.value.problems if p.severity == "error"}
    assert paths == {
        "model.container",
        "roles.prefill.container",
        "roles.decode.container",
        "frontend.container_image",
    }


@pytest.mark.parametrize("path", [B200, MI355X])
def test_resolved_yaml_round_trip(path: Path) -> None:
    loaded = load_recipe(path, cluster=AMD_CLUSTER if path == MI355X else CLUSTER)
    text = resolved_yaml(loaded)
    again = load_recipe_text(
        text,
        source="recipe.yaml",
        base_dir=Path("/nonexistent"),
        cluster=None,
        on_submit_host=False,
    )
    assert again.recipe == loaded.recipe
    # and a second round is a fixed point
    assert resolved_yaml(again).split("\n", 2)[2] == text.split("\n", 2)[2]


def test_resolved_yaml_masks_secrets_and_still_loads() -> None:
    text = edit("env: {}", "env: {HF_TOKEN: hf_abc, WANDB_API_KEY: k, PLAIN: v}")
    text = text.replace("schema: 2\n", "schema: 2\nenvironment: {MY_PASSWORD: pw}\n")
    loaded = load_text(text)
    out = resolved_yaml(loaded)
    assert "hf_abc" not in out
    assert "pw" not in out.split("MY_PASSWORD")[1].split("\n")[0]
    data = yaml.safe_load(out)
    assert data["roles"]["prefill"]["env"] == {
        "HF_TOKEN": "***",
        "WANDB_API_KEY": "***",
        "PLAIN": "v",
    }
    assert data["environment"] == {"MY_PASSWORD": "***"}
    load_recipe_text(out, source="r", base_dir=DATA)


def test_process_launcher_round_trip_without_images() -> None:
    loaded = load_recipe(B200, cluster=ClusterConfig(launcher="process"))
    again = load_recipe_text(resolved_yaml(loaded), source="r", base_dir=DATA)
    assert again.recipe == loaded.recipe


# ---- syntax and shape --------------------------------------------------------------------------


def test_yaml_syntax_error_has_line_and_column() -> None:
    exc = fail_text("name: x\nroles:\n  prefill: [1, 2\n")
    message = str(exc)
    assert "YAML syntax error" in message
    assert "line 4" in message or "line 3" in message
    assert "column" in message
    assert exc.problems[0].line is not None


def test_tab_indentation_is_a_syntax_error() -> None:
    exc = fail_text("name: x\nroles:\n\tprefill: {}\n")
    assert "line 3, column 1" in str(exc)
    assert "tabs" in exc.problems[0].hint


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(text: str) -> None:
    assert "top level must be a mapping" in str(fail_text(text))


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_empty_recipe(text: str) -> None:
    assert "empty" in str(fail_text(text))


def test_duplicate_keys_are_errors() -> None:
    exc = fail_text(
        edit(
            "gpu-memory-utilization: 0.75",
            "gpu-memory-utilization: 0.75\n      enforce-eager: false",
        )
    )
    problem = next(p for p in exc.problems if "duplicate" in p.message)
    assert problem.path == "roles.prefill.args.enforce-eager"
    assert problem.line == 27  # the second one (line 26 is gpu-memory-utilization)


@pytest.mark.parametrize(
    ("old", "new", "path", "expected"),
    [
        (
            "    nodes: 1\n    workers: 1\n    gpus: 8\n    env: {}",
            '    nodes: "two"\n    workers: 1\n    gpus: 8\n    env: {}',
            "roles.prefill.nodes",
            "an integer",
        ),
        ("env: {}", "env: {X: [1, 2]}", "roles.prefill.env.X", "a string"),
        ("env: {}", "env: [A=1]", "roles.prefill.env", "a mapping"),
        (
            "    args: {model: glm5",
            "    args: [model]\n    argz: {model: glm5",
            "roles.decode.args",
            "a mapping",
        ),
        (
            "health_check: {max_attempts: 720",
            "health_check: {max_attempts: lots",
            "health_check.max_attempts",
            "an integer",
        ),
        (
            "enable_multiple_frontends: false",
            "enable_multiple_frontends: nope",
            "frontend.enable_multiple_frontends",
            "true or false",
        ),
        ("resources: {gpu_type: b200, gpus_per_node: 8}", "resources: 8", "resources", "a mapping"),
    ],
)
def test_wrong_types_name_path_and_expected_type(
    old: str, new: str, path: str, expected: str
) -> None:
    exc = fail_text(edit(old, new))
    problem = next((p for p in exc.problems if p.path == path), None)
    assert problem is not None, str(exc)
    assert expected in problem.message
    assert path in str(exc)


def test_did_you_mean_for_unknown_keys() -> None:
    exc = fail_text(edit("    gpus: 8\n    args: {model", "    gpuz: 8\n    args: {model"))
    problem = next(p for p in exc.problems if p.path == "roles.decode.gpuz")
    assert "did you mean 'gpus'" in problem.hint
    exc = fail_text(edit("container_image: tilert-router", "container-image: tilert-router"))
    assert "did you mean 'container_image'" in str(exc)
    exc = fail_text(edit("health_check:", "helth_check:"))
    assert "did you mean 'health_check'" in str(exc)


def test_engine_flag_at_role_level_says_move_it_under_args() -> None:
    exc = fail_text(
        edit("    gpus: 8\n    args: {model", "    gpus: 8\n    max-seq-len: 1\n    args: {model")
    )
    problem = next(p for p in exc.problems if p.path == "roles.decode.max-seq-len")
    assert "roles.decode.args" in problem.hint


def test_srtctl_keys_we_do_not_support_say_why() -> None:
    exc = fail_text(b200_text() + "profiling: {type: torch}\ndynamo: {install: false}\n")
    message = str(exc)
    assert "profiling" in message
    assert "torch profiling" in message
    assert "dynamo" in message


def test_all_errors_together() -> None:
    text = edit("    gpus: 8\n    args: {model", "    gpuz: 8\n    args: {http-port: 1, model")
    text = text.replace("max_attempts: 720", "max_attempts: many")
    text = text.replace("transport: nixl,", "transport: mooncake,")
    exc = fail_text(text)
    paths = {p.path for p in exc.problems if p.severity == "error"}
    assert {
        "roles.decode.gpuz",  # unknown key
        "health_check.max_attempts",  # wrong type
        "roles.decode.args.http-port",  # rule
        "roles.prefill.args.kv-transfer-config.kv_connector_extra_config.tilert_transport",
    } <= paths
    assert "4 errors" in str(exc).splitlines()[0]


def test_pruned_values_do_not_cause_follow_up_noise() -> None:
    exc = fail_text(
        edit(
            "    nodes: 1\n    workers: 1\n    gpus: 8\n    args: {model",
            '    nodes: "x"\n    workers: 1\n    gpus: 8\n    args: {model',
        )
    )
    assert [p.path for p in exc.problems if p.severity == "error"] == ["roles.decode.nodes"]


def test_time_limit_stays_a_string() -> None:
    loaded = load_text(b200_text() + "slurm: {time_limit: 4:00:00}\n")
    assert loaded.recipe.slurm.time_limit == "4:00:00"
    assert loaded.recipe.slurm.account == "llm"  # cluster default still merged


def test_recipe_values_win_over_cluster_defaults() -> None:
    text = b200_text() + "slurm: {account: mine}\n"
    site = ClusterConfig(default_account="site", gpus_per_node=4, containers=CLUSTER.containers)
    loaded = load_text(text, cluster=site)
    assert loaded.recipe.slurm.account == "mine"
    assert loaded.recipe.resources.gpus_per_node == 8
    assert "resources.gpus_per_node" in {w.path for w in loaded.warnings}
    # Without the recipe's value the cluster's 4 GPUs per node apply, and 8-GPU roles do not fit.
    text = text.replace("gpus_per_node: 8}", "}")
    exc = fail_text(text, cluster=site)
    assert {"roles.decode.gpus", "roles.prefill.gpus"} <= {p.path for p in exc.problems}


def test_relative_paths_resolve_against_the_recipe_folder(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    text = b200_text().replace("path: hf:zai-org/GLM-5.1-FP8", "path: ./weights")
    text = text.replace("model-path: zai-org/GLM-5.1-FP8", "model-path: ../tok")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    loaded = load_recipe(recipe, cluster=CLUSTER)
    assert loaded.recipe.model.path == str(tmp_path / "weights")
    assert loaded.recipe.frontend.args["model-path"] == str(tmp_path.parent / "tok")
    assert loaded.warnings == []


def test_missing_recipe_file_is_a_recipe_error(tmp_path: Path) -> None:
    with pytest.raises(InputError) as info:
        load_recipe(tmp_path / "nope.yaml")
    assert "cannot read" in str(info.value)


def test_defaults_are_filled_for_the_planner() -> None:
    text = edit(
        "    nodes: 1\n    workers: 1\n    gpus: 8\n    args: {model",
        "    workers: 2\n    args: {model",
    )
    text = text.replace("    nodes: 1\n    workers: 1\n    gpus: 8\n    env: {}", "    env: {}")
    r = load_text(text).recipe
    assert r.roles.decode is not None
    assert r.roles.prefill is not None
    assert (r.roles.decode.nodes, r.roles.decode.workers, r.roles.decode.gpus) == (2, 2, 8)
    assert (r.roles.prefill.nodes, r.roles.prefill.workers, r.roles.prefill.gpus) == (1, 1, 8)


# ---- --set --------------------------------------------------------------------------------------


def test_set_creates_env_and_args_with_yaml_types() -> None:
    loaded = load_text(
        b200_text(),
        overrides=[
            "roles.prefill.env.HF_HUB_OFFLINE=1",
            "roles.decode.env.NEW=text",
            "roles.prefill.args.max-num-seqs=16",
            "roles.prefill.args.enforce-eager=false",
            "agent.router_port=8080",
        ],
    )
    r = loaded.recipe
    assert r.roles.prefill is not None
    assert r.roles.decode is not None
    assert r.roles.prefill.env["HF_HUB_OFFLINE"] == 1
    assert r.roles.decode.env == {"NEW": "text"}
    assert r.roles.prefill.args["max-num-seqs"] == 16
    assert r.roles.prefill.args["enforce-eager"] is False
    assert r.agent.router_port == 8080
    assert loaded.overridden[0] == "roles.prefill.env.HF_HUB_OFFLINE"


def test_set_problems_say_from_set() -> None:
    exc = fail_text(b200_text(), overrides=["roles.decode.nodes=two"])
    problem = next(p for p in exc.problems if p.path == "roles.decode.nodes")
    assert "--set" in problem.message
    assert problem.line is None


def test_bad_set_syntax_names_the_flag() -> None:
    exc = fail_text(b200_text(), overrides=["roles.decode.nodes"])
    assert "--set roles.decode.nodes" in str(exc)
    assert exc.source == "t.yaml"
