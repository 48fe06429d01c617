"""The cluster file: discovery order, checking, srtctl compatibility, image aliases."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.problems import InputError
from agent.recipe.cluster import (
    ClusterConfig,
    find_cluster_file,
    load_cluster,
    merged_mounts,
    read_cluster,
    resolve_image,
)

DATA = Path(__file__).parent / "data" / "recipes"


def write(tmp_path: Path, text: str, name: str = "srtslurm.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- discovery ---------------------------------------------------------------------------------


def test_discovery_order(tmp_path: Path) -> None:
    cwd_file = write(tmp_path, "gpus_per_node: 8\n")
    env_file = write(tmp_path, "gpus_per_node: 4\n", "env.yaml")
    flag_file = write(tmp_path, "gpus_per_node: 2\n", "flag.yaml")
    env = {"TILERT_CLUSTER_FILE": str(env_file)}
    assert find_cluster_file(str(flag_file), env, tmp_path) == flag_file
    assert find_cluster_file(None, env, tmp_path) == env_file
    assert find_cluster_file(None, {}, tmp_path) == cwd_file
    assert find_cluster_file(None, {"TILERT_CLUSTER_FILE": ""}, tmp_path) == cwd_file
    cwd_file.unlink()
    assert find_cluster_file(None, {}, tmp_path) is None


def test_relative_flag_is_relative_to_cwd(tmp_path: Path) -> None:
    write(tmp_path, "{}\n", "site.yaml")
    assert find_cluster_file("site.yaml", {}, tmp_path) == tmp_path / "site.yaml"


def test_missing_named_files_are_errors_naming_the_source(tmp_path: Path) -> None:
    write(tmp_path, "{}\n")  # a ./srtslurm.yaml must not silently replace a missing named file
    with pytest.raises(InputError) as info:
        find_cluster_file("nope.yaml", {}, tmp_path)
    assert "--cluster" in str(info.value)
    assert "nope.yaml" in str(info.value)
    with pytest.raises(InputError) as info:
        find_cluster_file(None, {"TILERT_CLUSTER_FILE": "/no/such.yaml"}, tmp_path)
    assert "TILERT_CLUSTER_FILE" in str(info.value)


# ---- loading -----------------------------------------------------------------------------------


def test_test_cluster_file_loads() -> None:
    cluster = load_cluster(DATA / "srtslurm.yaml")
    assert cluster.containers["tilert-router"].endswith(".sqsh")
    assert cluster.default_time_limit == "04:00:00"
    assert cluster.launcher == "pyxis"


def test_defaults(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, ""))
    assert cluster == ClusterConfig()
    assert cluster.visible_devices_env == "CUDA_VISIBLE_DEVICES"
    assert (cluster.launcher, cluster.configs_dir, cluster.kill_wait_s) == (
        "pyxis",
        "/configs",
        30.0,
    )
    assert (cluster.exclusive, cluster.signal_lead_s, cluster.agent_command) == (True, 120, None)


def test_agent_command_as_list_or_string(tmp_path: Path) -> None:
    assert load_cluster(
        write(tmp_path, "agent_command: [/opt/venv/bin/tilert-agent]\n")
    ).agent_command == ["/opt/venv/bin/tilert-agent"]
    assert (
        load_cluster(write(tmp_path, "agent_command: tilert-agent --x\n")).agent_command
        == "tilert-agent --x"
    )


def test_unknown_keys_and_wrong_types_all_reported(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "containres: {a: /x.sqsh}\ngpus_per_node: eight\nlauncher: slurm\ncontainers: {b: [1]}\n",
    )
    with pytest.raises(InputError) as info:
        load_cluster(path)
    exc = info.value
    by_path = {p.path: p for p in exc.problems}
    assert "did you mean 'containers'" in by_path["containres"].hint
    assert "an integer" in by_path["gpus_per_node"].message
    assert "'pyxis'" in by_path["launcher"].message
    assert "containers.b" in by_path
    assert by_path["gpus_per_node"].line == 2
    assert str(path) in str(exc)
    assert "containers.b" in str(exc)


def test_srtctl_keys_are_warnings(tmp_path: Path) -> None:
    cluster, warnings = read_cluster(
        write(tmp_path, "cluster: lyris\nuse_het_jobs: false\ngpus_per_node: 4\n")
    )
    assert cluster.gpus_per_node == 4
    assert {w.path for w in warnings} == {"cluster", "use_het_jobs"}
    assert all(w.severity == "warning" for w in warnings)


def test_syntax_error(tmp_path: Path) -> None:
    with pytest.raises(InputError) as info:
        load_cluster(write(tmp_path, "containers: {a: b\n"))
    assert "line" in str(info.value)
    assert "column" in str(info.value)


def test_semantic_checks(tmp_path: Path) -> None:
    with pytest.raises(InputError) as info:
        load_cluster(write(tmp_path, "kill_wait_s: 0\nvisible_devices_env: not a var\n"))
    assert {p.path for p in info.value.problems} == {"kill_wait_s", "visible_devices_env"}


def test_relative_model_paths_are_relative_to_the_cluster_file(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, "model_paths: {m: ./models/m, abs: /m}\n"))
    assert cluster.model_paths == {"m": str(tmp_path / "models" / "m"), "abs": "/m"}


# ---- images ------------------------------------------------------------------------------------

SITE = ClusterConfig(containers={"tilert-decode": "/i/d.sqsh", "tilert-prefill": "/i/p.sqsh"})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("tilert-decode", "/i/d.sqsh"),
        ("/images/x.sqsh", "/images/x.sqsh"),
        ("x.sqsh", "x.sqsh"),
        ("ghcr.io/tile-ai/tilert-rocm-decode:0.1.6", "ghcr.io/tile-ai/tilert-rocm-decode:0.1.6"),
        ("ubuntu:24.04", "ubuntu:24.04"),
        ("nvcr.io#nvidia/vllm", "nvcr.io#nvidia/vllm"),
    ],
)
def test_resolve_image(value: str, expected: str) -> None:
    assert resolve_image(value, SITE, "model.container") == expected


def test_bare_word_is_an_error_with_did_you_mean() -> None:
    with pytest.raises(InputError) as info:
        resolve_image("tilert-decod", SITE, "roles.decode.container")
    problem = info.value.problems[0]
    assert problem.path == "roles.decode.container"
    assert "did you mean 'tilert-decode'" in problem.hint


def test_bare_word_without_a_cluster_file() -> None:
    with pytest.raises(InputError) as info:
        resolve_image("ubuntu", None, "model.container")
    assert "srtslurm.yaml" in info.value.problems[0].hint
    assert "ubuntu:latest" in info.value.problems[0].hint


def test_merged_mounts() -> None:
    site = ClusterConfig(default_mounts={"/models": "/models", "/scratch": "/scratch"})
    assert merged_mounts(["/models:/m"], site) == ["/scratch:/scratch", "/models:/m"]
    assert merged_mounts({"/models": "/m"}, site) == {"/models": "/m", "/scratch": "/scratch"}
    assert merged_mounts(["/a:/a"], None) == ["/a:/a"]
