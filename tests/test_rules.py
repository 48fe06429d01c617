"""One invalid recipe per load-time rule: each must fail with the user's key path in the message."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.facts import human_int
from agent.problems import InputError, Problem
from agent.recipe.cluster import ClusterConfig, load_cluster
from agent.recipe.loader import LoadedRecipe, load_recipe_text
from agent.recipe.model import Recipe, Role, Roles
from agent.recipe.rules import check

DATA = Path(__file__).parent / "data" / "recipes"
CLUSTER = load_cluster(DATA / "srtslurm.yaml")
KV = "roles.prefill.args.kv-transfer-config"
EXTRA = f"{KV}.kv_connector_extra_config"

Mutation = Callable[[dict[str, Any]], None]


def b200() -> Any:
    return yaml.safe_load((DATA / "b200-nixl-glm5.yaml").read_text())


def load(data: dict[str, Any], cluster: ClusterConfig | None = CLUSTER) -> LoadedRecipe:
    text = yaml.safe_dump(data, sort_keys=False)
    return load_recipe_text(text, source="t.yaml", base_dir=DATA, cluster=cluster)


def failure(data: dict[str, Any], cluster: ClusterConfig | None = CLUSTER) -> InputError:
    with pytest.raises(InputError) as info:
        load(data, cluster)
    return info.value


def prefill(d: dict[str, Any]) -> Any:
    return d["roles"]["prefill"]


def decode(d: dict[str, Any]) -> Any:
    return d["roles"]["decode"]


def connector(d: dict[str, Any]) -> Any:
    """Turn the JSON string into a mapping (both forms are accepted) and return it."""
    import json

    args = prefill(d)["args"]
    if isinstance(args["kv-transfer-config"], str):
        args["kv-transfer-config"] = json.loads(args["kv-transfer-config"])
    return args["kv-transfer-config"]


def setter(getter: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: Any) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        getter(d)[key] = value

    return mutate


def deleter(getter: Callable[[dict[str, Any]], dict[str, Any]], key: str) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        del getter(d)[key]

    return mutate


def both(*mutations: Mutation) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        for m in mutations:
            m(d)

    return mutate


def frontend(d: dict[str, Any]) -> Any:
    return d["frontend"]


def fargs(d: dict[str, Any]) -> Any:
    return d["frontend"]["args"]


def pargs(d: dict[str, Any]) -> Any:
    return prefill(d)["args"]


def dargs(d: dict[str, Any]) -> Any:
    return decode(d)["args"]


def penv(d: dict[str, Any]) -> Any:
    return prefill(d).setdefault("env", {})


def denv(d: dict[str, Any]) -> Any:
    return decode(d).setdefault("env", {})


def extra(d: dict[str, Any]) -> Any:
    return connector(d)["kv_connector_extra_config"]


def model(d: dict[str, Any]) -> Any:
    return d["model"]


def top(d: dict[str, Any]) -> Any:
    return d


def roles(d: dict[str, Any]) -> Any:
    return d["roles"]


INVALID: list[tuple[str, Mutation, str]] = [
    # srtctl's rules
    ("engine+role engines", setter(top, "engine", "vllm"), "engine"),
    (
        "top-level engine only",
        both(setter(top, "engine", "vllm"), deleter(prefill, "engine"), deleter(decode, "engine")),
        "engine",
    ),
    ("role without engine", deleter(decode, "engine"), "roles.decode.engine"),
    ("frontend dynamo", setter(frontend, "type", "dynamo"), "frontend.type"),
    ("frontend type missing", deleter(frontend, "type"), "frontend.type"),
    (
        "multiple frontends",
        setter(frontend, "enable_multiple_frontends", True),
        "frontend.enable_multiple_frontends",
    ),
    ("router vllm_url", setter(fargs, "vllm_url", "http://x:1"), "frontend.args.vllm_url"),
    ("router decode", setter(fargs, "decode", "h:1:2"), "frontend.args.decode"),
    ("router host", setter(fargs, "host", "0.0.0.0"), "frontend.args.host"),
    ("router port", setter(fargs, "port", 9000), "frontend.args.port"),
    ("decode engine vllm", setter(decode, "engine", "vllm"), "roles.decode.engine"),
    (
        "prefill engine sglang",
        setter(prefill, "engine", {"type": "sglang"}),
        "roles.prefill.engine",
    ),
    ("engine mapping without type", setter(prefill, "engine", {"x": 1}), "roles.prefill.engine"),
    ("two prefill workers", setter(prefill, "workers", 2), "roles.prefill.workers"),
    ("no decode worker", setter(decode, "workers", 0), "roles.decode.workers"),
    ("aggregated workers", setter(roles, "agg", {"engine": "vllm"}), "roles.agg"),
    (
        "decode served name differs",
        setter(dargs, "served-model-name", "other"),
        "roles.decode.args.served-model-name",
    ),
    (
        "decode served_name differs (underscore)",
        setter(dargs, "served_model_name", "other"),
        "roles.decode.args.served_model_name",
    ),
    (
        "decode engine served_model_name differs",
        setter(decode, "engine", {"type": "tilert", "served_model_name": "x"}),
        "roles.decode.engine.served_model_name",
    ),
    ("decode too big for a node", setter(decode, "gpus", 16), "roles.decode.gpus"),
    ("prefill too big for a node", setter(prefill, "gpus", 16), "roles.prefill.gpus"),
    ("no prefill role", deleter(roles, "prefill"), "roles.prefill"),
    ("no decode role", deleter(roles, "decode"), "roles.decode"),
    # srtctl's late failures, now at load time
    ("decode --engine", setter(dargs, "engine", "stub"), "roles.decode.args.engine"),
    ("decode --http-port", setter(dargs, "http-port", 1), "roles.decode.args.http-port"),
    ("decode --ctrl_port", setter(dargs, "ctrl_port", 1), "roles.decode.args.ctrl_port"),
    ("prefill --host", setter(pargs, "host", "0.0.0.0"), "roles.prefill.args.host"),
    ("prefill --port", setter(pargs, "port", 8000), "roles.prefill.args.port"),
    ("prefill --model", setter(pargs, "model", "/m"), "roles.prefill.args.model"),
    ("decode spans nodes", setter(decode, "nodes", 2), "roles.decode.nodes"),
    ("decode workers packed", setter(decode, "workers", 2), "roles.decode.nodes"),
    ("multi-node prefill", setter(prefill, "nodes", 2), "roles.prefill.nodes"),
    # consistency
    ("kv-transfer-config missing", deleter(pargs, "kv-transfer-config"), KV),
    ("kv-transfer-config not JSON", setter(pargs, "kv-transfer-config", "{oops"), KV),
    ("kv-transfer-config a list", setter(pargs, "kv-transfer-config", [1]), KV),
    ("wrong connector", setter(connector, "kv_connector", "NixlConnector"), f"{KV}.kv_connector"),
    (
        "wrong module",
        setter(connector, "kv_connector_module_path", "x.y"),
        f"{KV}.kv_connector_module_path",
    ),
    ("wrong kv_role", setter(connector, "kv_role", "kv_both"), f"{KV}.kv_role"),
    ("transport mismatch", setter(dargs, "transport", "mooncake"), f"{EXTRA}.tilert_transport"),
    ("transport default mismatch", deleter(dargs, "transport"), f"{EXTRA}.tilert_transport"),
    (
        "prefill transport default mismatch",
        deleter(extra, "tilert_transport"),
        f"{EXTRA}.tilert_transport",
    ),
    ("unknown transport", setter(dargs, "transport", "tcp"), "roles.decode.args.transport"),
    ("seq len mismatch", setter(dargs, "max-seq-len", 131072), f"{EXTRA}.tilert_max_seq_len"),
    ("seq len decode default", deleter(dargs, "max-seq-len"), f"{EXTRA}.tilert_max_seq_len"),
    (
        "seq len above max-model-len",
        setter(pargs, "max-model-len", 100000),
        f"{EXTRA}.tilert_max_seq_len",
    ),
    (
        "seq len unknown",
        both(deleter(extra, "tilert_max_seq_len"), deleter(pargs, "max-model-len")),
        f"{EXTRA}.tilert_max_seq_len",
    ),
    ("model profile mismatch", setter(dargs, "model", "glm5_2"), f"{EXTRA}.tilert_model"),
    ("prefill profile default", setter(extra, "tilert_model", "dsv32"), f"{EXTRA}.tilert_model"),
    ("unknown decode profile", setter(dargs, "model", "glm6"), "roles.decode.args.model"),
    (
        "no token ids",
        deleter(pargs, "return-tokens-as-token-ids"),
        "roles.prefill.args.return-tokens-as-token-ids",
    ),
    (
        "token ids false",
        setter(pargs, "return-tokens-as-token-ids", False),
        "roles.prefill.args.return-tokens-as-token-ids",
    ),
    (
        "decode mtp without prefill mtp",
        deleter(pargs, "speculative-config"),
        "roles.decode.args.with-mtp",
    ),
    (
        "prefill mtp without decode mtp",
        deleter(dargs, "with-mtp"),
        "roles.prefill.args.speculative-config",
    ),
    (
        "speculative-config bad JSON",
        setter(pargs, "speculative-config", "{method: mtp"),
        "roles.prefill.args.speculative-config",
    ),
    ("num-mtp not 3", setter(dargs, "num-mtp", 2), "roles.decode.args.num-mtp"),
    ("tilert_host bracketed", setter(extra, "tilert_host", "[10.0.0.1]"), f"{EXTRA}.tilert_host"),
    ("tilert_host a name", setter(extra, "tilert_host", "node1"), f"{EXTRA}.tilert_host"),
    ("tilert_host IPv6", setter(extra, "tilert_host", "fe80::1"), f"{EXTRA}.tilert_host"),
    (
        "senders differ",
        setter(denv, "TILERT_PD_SENDERS", "4"),
        "roles.decode.env.TILERT_PD_SENDERS",
    ),
    (
        "senders differ from the environment",
        both(
            setter(top, "environment", {"TILERT_PD_SENDERS": "8"}),
            setter(penv, "TILERT_PD_SENDERS", 4),
        ),
        "roles.prefill.env.TILERT_PD_SENDERS",
    ),
    (
        "speculative-config on the decode",
        setter(dargs, "speculative-config", '{"method":"mtp","num_speculative_tokens":3}'),
        "roles.decode.args.speculative-config",
    ),
    (
        "speculative-config on the decode without with-mtp",
        both(
            deleter(dargs, "with-mtp"),
            deleter(pargs, "speculative-config"),
            setter(dargs, "speculative-config", '{"method":"mtp","num_speculative_tokens":1}'),
        ),
        "roles.decode.args.speculative-config",
    ),
    (
        "no-mtp on both sides with with-mtp",
        both(setter(penv, "TILERT_PD_NO_MTP", "1"), setter(denv, "TILERT_PD_NO_MTP", "1")),
        "roles.decode.env.TILERT_PD_NO_MTP",
    ),
    (
        "no-mtp on one side",
        setter(penv, "TILERT_PD_NO_MTP", "1"),
        "roles.prefill.env.TILERT_PD_NO_MTP",
    ),
    (
        "tp below senders",
        setter(pargs, "tensor-parallel-size", 4),
        "roles.prefill.args.tensor-parallel-size",
    ),
    (
        "tp default below senders",
        deleter(pargs, "tensor-parallel-size"),
        "roles.prefill.args.tensor-parallel-size",
    ),
    ("kv dtype pair", setter(dargs, "kv-cache-dtype", "bf16"), "roles.decode.args.kv-cache-dtype"),
    (
        "kv dtype defaults disagree",
        both(deleter(pargs, "kv-cache-dtype"), deleter(dargs, "kv-cache-dtype")),
        "roles.decode.args.kv-cache-dtype",
    ),
    (
        "vLLM fp8 on the fp8 MLA decode",
        setter(pargs, "kv-cache-dtype", "fp8"),
        "roles.decode.args.kv-cache-dtype",
    ),
    (
        "unknown prefill kv dtype",
        setter(pargs, "kv-cache-dtype", "fp8_e5m2"),
        "roles.prefill.args.kv-cache-dtype",
    ),
    (
        "unknown decode kv dtype",
        setter(dargs, "kv-cache-dtype", "int4"),
        "roles.decode.args.kv-cache-dtype",
    ),
    ("router model-path missing", deleter(fargs, "model-path"), "frontend.args.model-path"),
    ("router parser unknown", setter(fargs, "parser", "glm99"), "frontend.args.parser"),
    (
        "image not an alias",
        setter(prefill, "container", "tilert-prefil"),
        "roles.prefill.container",
    ),
    (
        "router image not an alias",
        setter(frontend, "container_image", "router"),
        "frontend.container_image",
    ),
    (
        "no prefill image",
        both(deleter(prefill, "container"), deleter(model, "container")),
        "roles.prefill.container",
    ),
    ("model path not an alias", setter(model, "path", "glm5.1"), "model.path"),
    ("model missing", deleter(top, "model"), "model.path"),
    ("name missing", deleter(top, "name"), "name"),
    ("name with a slash", setter(top, "name", "a/b"), "name"),
    ("schema 1", setter(top, "schema", 1), "schema"),
    ("torch profiling", setter(top, "profiling", {"type": "torch"}), "profiling"),
    ("sidecar", setter(decode, "sidecar", True), "roles.decode.sidecar"),
    ("router port range", setter(top, "agent", {"router_port": 70000}), "agent.router_port"),
    (
        "empty prefill command",
        setter(top, "agent", {"prefill_command": []}),
        "agent.prefill_command",
    ),
    (
        "blank word in the prefill command",
        setter(top, "agent", {"prefill_command": ["vllm", " "]}),
        "agent.prefill_command[1]",
    ),
    ("blank decode python", setter(top, "agent", {"decode_python": ""}), "agent.decode_python"),
    (
        "router python with spaces",
        setter(top, "agent", {"router_python": " python"}),
        "agent.router_python",
    ),
    ("relative scratch dir", setter(top, "agent", {"scratch_dir": "tmp"}), "agent.scratch_dir"),
    (
        "canary attempt timeout",
        setter(top, "agent", {"canary": {"attempt_timeout_s": 0}}),
        "agent.canary.attempt_timeout_s",
    ),
    (
        "prefill command not a list",
        setter(top, "agent", {"prefill_command": "vllm serve"}),
        "agent.prefill_command",
    ),
    (
        "health interval",
        setter(top, "health_check", {"interval_seconds": 0}),
        "health_check.interval_seconds",
    ),
]


@pytest.mark.parametrize(("mutate", "path"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_each_rule_names_the_key(mutate: Mutation, path: str) -> None:
    data = b200()
    mutate(data)
    exc = failure(data)
    errors = [p for p in exc.problems if p.severity == "error"]
    assert path in [p.path for p in errors], str(exc)
    assert path in str(exc)
    assert all(p.hint for p in exc.problems), str(exc)


def test_reference_recipe_is_valid_to_start_with() -> None:
    loaded = load(b200())
    assert loaded.recipe.roles.decode is not None


def _paths(problems: list[Problem]) -> list[str]:
    return [p.path for p in problems]


@pytest.mark.parametrize(
    ("prefill_kv", "decode_kv"),
    [
        ("fp8_ds_mla", "fp8"),
        ("fp8_ds_mla", "fp8_e4m3"),
        ("fp8_ds_mla", None),
        ("bfloat16", "bf16"),
        ("auto", "bfloat16"),
        (None, "bf16"),
        ("fp8", "fp8_rocm"),
        ("fp8_e4m3", "fp8_rocm"),
    ],
)
def test_compatible_kv_dtype_pairs_load(prefill_kv: str | None, decode_kv: str | None) -> None:
    data = b200()
    for args, value in ((pargs(data), prefill_kv), (dargs(data), decode_kv)):
        if value is None:
            del args["kv-cache-dtype"]
        else:
            args["kv-cache-dtype"] = value
    load(data)


def test_connector_as_a_mapping_and_engine_as_a_mapping() -> None:
    data = b200()
    connector(data)
    prefill(data)["engine"] = {"type": "vllm"}
    loaded = load(data)
    assert isinstance(loaded.recipe.roles.prefill.args["kv-transfer-config"], dict)  # type: ignore[union-attr]


def test_transport_defaults_agree_when_both_absent() -> None:
    data = b200()
    del dargs(data)["transport"]
    del extra(data)["tilert_transport"]
    load(data)


def test_senders_agree_through_the_environment_and_cover_tp() -> None:
    data = b200()
    data["environment"] = {"TILERT_PD_SENDERS": "4", "TILERT_PD_NO_MTP": "1"}
    # TILERT_PD_NO_MTP=1: no MTP layer, so neither side turns MTP on.
    del pargs(data)["speculative-config"], dargs(data)["with-mtp"]
    pargs(data)["tensor-parallel-size"] = 4
    prefill(data)["gpus"] = 4
    load(data)


def test_decode_served_name_equal_is_a_warning_and_dropped() -> None:
    data = b200()
    dargs(data)["served-model-name"] = pargs(data)["served-model-name"]
    loaded = load(data)
    assert "roles.decode.args.served-model-name" in _paths(loaded.warnings)
    assert "served-model-name" not in loaded.recipe.roles.decode.args  # type: ignore[union-attr]


def test_hub_id_model_path_warns_only() -> None:
    loaded = load(b200())
    assert {"frontend.args.model-path", "model.path"} <= set(_paths(loaded.warnings))
    assert all(w.severity == "warning" for w in loaded.warnings)


def test_missing_parser_warns() -> None:
    data = b200()
    del fargs(data)["parser"]
    assert "frontend.args.parser" in _paths(load(data).warnings)


def test_process_launcher_needs_no_images() -> None:
    data = b200()
    for role in (prefill(data), decode(data)):
        del role["container"]
    del data["model"]["container"]
    del frontend(data)["container_image"]
    process = ClusterConfig(launcher="process")
    loaded = load(data, process)
    assert loaded.recipe.roles.prefill.container is None  # type: ignore[union-attr]
    # Unresolvable aliases are not needed either: a warning, and dropped.
    loaded = load(b200(), process)
    assert "roles.prefill.container" in _paths(loaded.warnings)
    assert loaded.recipe.roles.prefill.container is None  # type: ignore[union-attr]


def test_pyxis_requires_router_image() -> None:
    data = b200()
    del frontend(data)["container_image"]
    del data["model"]["container"]
    exc = failure(data)
    assert "frontend.container_image" in _paths(exc.problems)


def test_image_did_you_mean() -> None:
    data = b200()
    prefill(data)["container"] = "tilert-prefil"
    assert "did you mean 'tilert-prefill'" in str(failure(data))


def test_check_on_a_bare_recipe_reports_without_crashing() -> None:
    problems = check(Recipe())
    paths = _paths(problems)
    assert {"name", "frontend.type", "roles.prefill", "roles.decode", "model.path"} <= set(paths)


def test_check_works_on_a_struct_built_in_code() -> None:
    recipe = Recipe(roles=Roles(prefill=Role(engine="vllm"), decode=Role(engine="tilert")))
    assert f"{EXTRA}.tilert_transport" not in _paths(check(recipe))  # both default mooncake
    assert KV in _paths(check(recipe))


def test_human_readable_max_model_len() -> None:
    assert human_int("1k") == 1000
    assert human_int("1K") == 1024
    assert human_int("25.6k") == 25600
    assert human_int(202752) == 202752
    assert human_int("lots") is None
    data = b200()
    pargs(data)["max-model-len"] = "198K"
    load(data)


def test_mutations_do_not_share_state() -> None:
    a, b = b200(), copy.deepcopy(b200())
    setter(dargs, "transport", "mooncake")(a)
    assert dargs(b)["transport"] == "nixl"


def test_agent_logs_location_and_node_dir() -> None:
    """agent.logs: location job|node and an absolute node_dir, each error naming its key."""
    data = b200()
    data["agent"] = {"logs": {"location": "node", "node_dir": "/local/tilert-logs"}}
    assert load(data).recipe.agent.logs.location == "node"
    data["agent"]["logs"] = {"location": "nfs"}
    exc = failure(data)
    assert "agent.logs.location" in _paths(exc.problems)
    assert "'job', 'node'" in str(exc)
    data["agent"]["logs"] = {"location": "node", "node_dir": "tilert-logs", "max_bytes": 0}
    exc = failure(data)
    assert {"agent.logs.node_dir", "agent.logs.max_bytes"} <= set(_paths(exc.problems))
    assert "not an absolute path" in str(exc)


@pytest.mark.parametrize(
    ("router", "engine", "keys"),
    [
        ({"chat-template": "/m/a.jinja"}, {}, ("chat-template", "chat-template")),
        ({}, {"chat_template": "/m/a.jinja"}, ("chat-template", "chat_template")),
        (
            {"chat_template": "/m/a.jinja"},
            {"chat-template": "/m/b.jinja"},
            ("chat_template", "chat-template"),
        ),
        (
            {"default-chat-template-kwargs": '{"enable_thinking": false}'},
            {"default-chat-template-kwargs": {"enable_thinking": True}},
            ("default-chat-template-kwargs", "default-chat-template-kwargs"),
        ),
    ],
)
def test_router_and_prefill_chat_templates_must_agree(
    router: dict[str, Any], engine: dict[str, Any], keys: tuple[str, str]
) -> None:
    """TileRT 0.1.6.post3's router turns its tokenization off when these differ: refused at load,
    naming the router's key and the prefill's in the user's spelling."""
    data = b200()
    data.setdefault("frontend", {}).setdefault("args", {}).update(router)
    prefill(data)["args"].update(engine)
    exc = failure(data)
    text = str(exc)
    assert f"frontend.args.{keys[0]}" in _paths(exc.problems), text
    assert f"roles.prefill.args.{keys[1]}" in text, text


def test_router_and_prefill_chat_templates_equal_load() -> None:
    data = b200()
    data.setdefault("frontend", {}).setdefault("args", {}).update(
        {"chat-template": "/m/a.jinja", "default-chat-template-kwargs": {"enable_thinking": False}}
    )
    prefill(data)["args"].update(
        {
            "chat-template": "/m/a.jinja",
            "default-chat-template-kwargs": '{"enable_thinking": false}',
        }
    )
    assert load(data).recipe.frontend.args["chat-template"] == "/m/a.jinja"
