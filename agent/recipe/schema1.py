"""srtctl schema 1 with ``backend.type: tilert`` (the SemiAnalysis fork, run by InferenceX) as
schema 2.

``translate`` maps a raw schema-1 tree onto the schema-2 tree the rest of the loader reads, key by
key, as the fork's adapter turns it into commands (docs/recipe.md, "recipes from srtctl 2.x and
InferenceX"): the ``backend`` keys become the prefill's and decode's args, env, images and the
weights conversion; ``resources.<role>_*`` the roles' layout; ``srun_options`` the pyxis flags
they mean; ``identity.frameworks`` the version pins of ``agent.frameworks``. It also returns
``origin``, where each schema-2 key came from, so that every problem found later (a shape, a
range, an agreement rule) is told in the user's own schema-1 key and line (``Origins.relocate``).
A key whose meaning cannot be kept is refused here with its name, why, and the schema-2 spelling.

``tilert-submit migrate`` writes the same translation as a schema-2 file (agent.recipe.migrate).
Imports facts, problems and the recipe model only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from agent.facts import (
    CONNECTOR,
    CONNECTOR_MODULE,
    CONNECTOR_ROLE,
    CONVERTER_MODEL_TYPES,
    TILERT_MODELS,
)
from agent.problems import Problem, error, warning
from agent.recipe.model import DEFAULT_GPUS_PER_NODE

HF_PREFIX = "hf:"
BACKEND_TYPE = "tilert"

# The fork's TileRTProtocol defaults (SemiAnalysisAI/srt-slurm src/srtctl/backends/tilert.py):
# a schema-1 recipe that leaves a key out means these.
DEFAULTS: dict[str, Any] = {
    "model_profile": "glm5",
    "weight_model_type": "glm-5",
    "weights_dir": "/tilert_weights",
    "max_seq_len": 202752,
    "kv_cache_dtype": "fp8",
    "prefill_kv_cache_dtype": "fp8_ds_mla",
    "transport": "nixl",
    "with_mtp": True,
    "speculative_tokens": 1,
}
_BACKEND_KEYS = (
    "type",
    "served_model_name",
    "prefill_container",
    "prefill_environment",
    "decode_environment",
    "tilert_config",
    *DEFAULTS,
)
# The args the fork derives from the backend keys; tilert_config may not set them.
_FORK_MANAGED = {
    "prefill": (
        "host",
        "port",
        "served-model-name",
        "tensor-parallel-size",
        "max-model-len",
        "return-tokens-as-token-ids",
        "kv-cache-dtype",
        "kv-transfer-config",
        "speculative-config",
    ),
    "decode": (
        "engine",
        "model",
        "model-weights-dir",
        "max-seq-len",
        "kv-cache-dtype",
        "transport",
        "ctrl-port",
        "http-port",
        "with-mtp",
    ),
}
# Schema-1 resources keys -> the role key they mean.
_LAYOUT = {"nodes": "{r}_nodes", "workers": "{r}_workers", "gpus": "gpus_per_{r}"}
# srun_options the pyxis launcher can pass on each engine's step (all take no value).
PYXIS_FLAGS = (
    "container-writable",
    "container-readonly",
    "container-remap-root",
    "no-container-remap-root",
)
# Top-level keys that mean the same in both schemas.
_SAME = (
    "name",
    "model",
    "slurm",
    "environment",
    "container_mounts",
    "extra_mount",
    "setup_script",
    "health_check",
    "benchmark",
    "sweep",
    "agent",
)
_EXTRA = "kv_connector_extra_config"
# TileRT profiles whose weights TileRT's weight_converter does not make (glm5_2: its own).
OWN_CONVERTER = tuple(m for m in TILERT_MODELS if m not in CONVERTER_MODEL_TYPES)
_KV = "roles.prefill.args.kv-transfer-config"


def _section(raw: Any) -> str | None:
    """Where the fork's TileRT keys are: ``backend``, or ``engine`` (its later spelling, without
    ``roles``); None when the tree is not the fork's."""
    if not isinstance(raw, dict) or raw.get("schema") not in (None, 1):
        return None
    for key in ("backend", "engine"):
        section = raw.get(key)
        if isinstance(section, dict) and section.get("type") == BACKEND_TYPE:
            return key if key == "backend" or "roles" not in raw else None
    return None


def is_schema1(raw: Any) -> bool:
    """Whether a raw recipe tree is the fork's schema 1 (``backend.type: tilert``)."""
    return _section(raw) is not None


@dataclass
class Origins:
    """Where each schema-2 key of a translation came from (dotted paths), and what was refused."""

    paths: dict[str, str] = field(default_factory=dict)
    # Schema-2 paths made from a schema-1 key rather than renamed from it: what lies under them
    # has no schema-1 spelling of its own, so a problem there names the key itself.
    derived: set[str] = field(default_factory=set)
    problems: list[Problem] = field(default_factory=list)

    def note(self, new: str, old: str) -> None:
        """``new`` (schema 2) is ``old`` (schema 1) renamed; what is under it keeps its keys."""
        self.paths[new] = old

    def derive(self, new: str, old: str) -> None:
        """``new`` (schema 2) is made from ``old`` (schema 1)."""
        self.paths[new] = old
        self.derived.add(new)

    def old(self, path: str) -> str:
        """A schema-2 path in the user's schema-1 spelling (its nearest noted ancestor)."""
        cut = path
        while cut:
            if cut in self.paths:
                if cut in self.derived:
                    return self.paths[cut]
                return self.paths[cut] + path[len(cut) :]
            end = max(cut.rfind("."), cut.rfind("["))
            if end <= 0:
                break
            cut = cut[:end]
        return path

    def relocate(self, problem: Problem) -> Problem:
        """``problem`` told in schema-1 keys: its path, and every schema-2 path its words quote."""
        return msgspec.structs.replace(
            problem,
            path=self.old(problem.path),
            message=self._words(problem.message),
            hint=self._words(problem.hint),
        )

    def _words(self, text: str) -> str:
        # Longest first, so roles.decode.args.model-weights-dir is not read as ...args.model.
        for new in sorted(self.paths, key=len, reverse=True):
            if new in text:
                # Escaped for the template: a key's own backslashes are text (a user's typo).
                old = self.paths[new].replace("\\", "\\\\")
                text = re.sub(re.escape(new) + r"(?![\w.\[-])", old, text)
        return text


def _refuse(origins: Origins, path: str, why: str, fix: str) -> None:
    origins.problems.append(error(path, why, fix))


def translate(raw: dict[str, Any]) -> tuple[dict[str, Any], Origins]:
    """The schema-2 tree a schema-1 tree means, with where each key came from."""
    if _section(raw) != "engine":
        return _translate(raw)
    # The later fork spells the section ``engine``: read it as ``backend``, then name it back.
    tree, origins = _translate({("backend" if k == "engine" else k): v for k, v in raw.items()})
    word = re.compile(r"\bbackend\b")
    origins.paths = {new: word.sub("engine", old) for new, old in origins.paths.items()}
    origins.problems = [
        msgspec.structs.replace(
            p,
            path=word.sub("engine", p.path),
            message=word.sub("engine", p.message),
            hint=word.sub("engine", p.hint),
        )
        for p in origins.problems
    ]
    return tree, origins


def _translate(raw: dict[str, Any]) -> tuple[dict[str, Any], Origins]:
    origins = Origins()
    out: dict[str, Any] = {"schema": 2}
    _same(out, raw, "name", origins)
    _same(out, raw, "model", origins)
    backend = dict(raw.get("backend") or {})
    resources = raw.get("resources")
    roles = _roles(raw, backend, origins)
    if isinstance(resources, dict):
        out["resources"] = _resources(resources, roles, origins)
    else:
        _same(out, raw, "resources", origins)
    _same(out, raw, "environment", origins)
    out["roles"] = roles
    origins.derive("roles", "backend")
    origins.derive("roles.prefill", "backend")
    origins.derive("roles.decode", "backend")
    out["frontend"] = _frontend(raw, origins)
    for key in _SAME:
        if key not in out:
            _same(out, raw, key, origins)
    if isinstance(out.get("agent"), dict):
        out["agent"] = dict(out["agent"])  # ours to add to, never the caller's tree
    _identity(raw, out, origins)
    _dynamo(raw, origins)
    _srun_options(raw, out, origins)
    handled = (*_SAME, "schema", "backend", "resources", "frontend", "identity", "dynamo")
    for key in raw:
        if key not in (*handled, "srun_options"):
            # Unknown to both schemas, or a schema-2 key in a schema-1 file: the schema-2 shape
            # check names it (with its advice) at its own line.
            out[key] = raw[key]
            origins.note(str(key), str(key))
    return out, origins


def _same(out: dict[str, Any], raw: dict[str, Any], key: str, origins: Origins) -> None:
    if key in raw:
        out[key] = raw[key]
        origins.note(str(key), str(key))


def _resources(
    resources: dict[str, Any], roles: dict[str, Any], origins: Origins
) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    layout_keys = {
        fmt.format(r=role): (role, new)
        for role in ("prefill", "decode", "agg")
        for new, fmt in _LAYOUT.items()
    }
    for key, value in resources.items():
        target = layout_keys.get(str(key))
        if target is None:
            kept[key] = value
            origins.note(f"resources.{key}", f"resources.{key}")
            continue
        role, new = target
        role_map = roles.setdefault(role, {}) if role != "agg" else roles.setdefault("agg", {})
        if isinstance(role_map, dict):
            role_map[new] = value
        origins.derive(f"roles.{role}.{new}", f"resources.{key}")
    return kept


def _mapping(tree: dict[str, Any], key: str) -> dict[str, Any]:
    """``tree[key]`` when it is a mapping, else {} (the shape check names a wrong one)."""
    value = tree.get(key)
    return value if isinstance(value, dict) else {}


def _hub_id(path: Any) -> str | None:
    if isinstance(path, str) and path.startswith(HF_PREFIX):
        return path[len(HF_PREFIX) :].strip() or None
    return None


def _roles(raw: dict[str, Any], backend: dict[str, Any], origins: Origins) -> dict[str, Any]:
    for key in backend:
        if key not in _BACKEND_KEYS:
            _refuse(
                origins,
                f"backend.{key}",
                f"unknown key '{key}' in a schema-1 TileRT backend",
                "keys allowed under backend: " + ", ".join(_BACKEND_KEYS),
            )
    value = {k: backend.get(k, d) for k, d in DEFAULTS.items()}
    # A derived arg whose key the recipe leaves out (its default) points at backend itself.
    where = {key: f"backend.{key}" if key in backend else "backend" for key in DEFAULTS}
    config = {} if backend.get("tilert_config") is None else backend["tilert_config"]
    if not isinstance(config, dict):
        _refuse(
            origins, "backend.tilert_config", "expected a mapping", "write prefill: and decode:"
        )
        config = {}
    for key in config:
        if key not in ("prefill", "decode"):
            _refuse(
                origins,
                f"backend.tilert_config.{key}",
                f"unknown key '{key}'",
                "keys allowed under backend.tilert_config: prefill, decode",
            )
    prefill = _prefill(raw, backend, value, where, origins)
    decode = _decode(value, where, origins)
    for role, args, env in (
        ("prefill", prefill["args"], "prefill_environment"),
        ("decode", decode["args"], "decode_environment"),
    ):
        _role_config(config, role, args, origins)
        target = prefill if role == "prefill" else decode
        role_env = backend.get(env)
        if role_env is not None:
            target["env"] = _with_role(role_env, role, raw.get("environment"))
            origins.note(f"roles.{role}.env", f"backend.{env}")
        else:
            target["env"] = {"TILERT_ROLE": role}
            origins.derive(f"roles.{role}.env", "backend")
    if "prefill_container" in backend:
        prefill["container"] = backend["prefill_container"]
        origins.derive("roles.prefill.container", "backend.prefill_container")
    if value["model_profile"] in OWN_CONVERTER and "weight_model_type" not in backend:
        # srtctl would run TileRT's glm-5 converter (its default weight_model_type) and find the
        # folder already converted; this profile's weights come from its own converter.
        origins.problems.append(
            warning(
                "backend.model_profile",
                f"the {value['model_profile']} profile's weights are made by its own converter, "
                "not by srtctl's weight_model_type conversion: backend.weights_dir must hold "
                "them already (it is not converted)",
                "convert them by hand (docs/weights.md)",
            )
        )
    else:
        decode["convert"] = _convert(raw, value, origins)
    return {"prefill": prefill, "decode": decode}


def _with_role(env: Any, role: str, top: Any) -> Any:
    """A role's env as the fork builds it: the top-level environment wins over the role's, then
    TILERT_ROLE=<role> (the setup script branches on it) wins over both."""
    if not isinstance(env, dict):
        return env  # the shape check names it
    shadowed = set(top) if isinstance(top, dict) else set()
    return {**{k: v for k, v in env.items() if k not in shadowed}, "TILERT_ROLE": role}


def _prefill(
    raw: dict[str, Any],
    backend: dict[str, Any],
    value: dict[str, Any],
    where: dict[str, str],
    origins: Origins,
) -> dict[str, Any]:
    args: dict[str, Any] = {}
    hub = _hub_id(_mapping(raw, "model").get("path"))
    if "served_model_name" in backend:
        args["served-model-name"] = backend["served_model_name"]
        origins.note("roles.prefill.args.served-model-name", "backend.served_model_name")
    elif hub is not None:
        # The fork passes the hub id as the served name; vLLM's default for a folder is its path.
        args["served-model-name"] = hub
        origins.derive("roles.prefill.args.served-model-name", "model.path")
    # The fork's TP is the prefill worker's GPU count: gpus_per_prefill, else a whole node.
    resources = _mapping(raw, "resources")
    for key in ("gpus_per_prefill", "gpus_per_node"):
        if resources.get(key) is not None:
            args["tensor-parallel-size"] = resources[key]
            origins.derive("roles.prefill.args.tensor-parallel-size", f"resources.{key}")
            break
    else:
        args["tensor-parallel-size"] = DEFAULT_GPUS_PER_NODE
        origins.derive("roles.prefill.args.tensor-parallel-size", "resources")
    args["max-model-len"] = value["max_seq_len"]
    args["return-tokens-as-token-ids"] = True
    args["kv-cache-dtype"] = value["prefill_kv_cache_dtype"]
    extra = {
        "tilert_model": value["model_profile"],
        "tilert_max_seq_len": value["max_seq_len"],
        "tilert_transport": value["transport"],
    }
    args["kv-transfer-config"] = _json(
        {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": CONNECTOR_ROLE,
            _EXTRA: extra,
        }
    )
    origins.derive("roles.prefill.args.max-model-len", where["max_seq_len"])
    origins.derive("roles.prefill.args.kv-cache-dtype", where["prefill_kv_cache_dtype"])
    origins.derive(_KV, "backend")
    origins.derive(f"{_KV}.{_EXTRA}.tilert_model", where["model_profile"])
    origins.derive(f"{_KV}.{_EXTRA}.tilert_max_seq_len", where["max_seq_len"])
    origins.derive(f"{_KV}.{_EXTRA}.tilert_transport", where["transport"])
    tokens = value["speculative_tokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 64:
        _refuse(
            origins,
            where["speculative_tokens"],
            f"expected an integer from 1 to 64, got {tokens!r}",
            "write speculative_tokens: 1 (TileRT's MTP layer; schema 2: num_speculative_tokens "
            "in roles.prefill.args.speculative-config)",
        )
    if value["with_mtp"] is False and "speculative_tokens" in backend:
        # The fork reads speculative_tokens only with MTP on: it would run without MTP, silently.
        _refuse(
            origins,
            where["speculative_tokens"],
            f"speculative_tokens: {tokens!r} is how many tokens MTP drafts, and with_mtp: false "
            "turns MTP off (the job would run without MTP)",
            "set with_mtp: true to run with MTP, or remove speculative_tokens to run without",
        )
    if value["with_mtp"] is True:
        spec = {"method": "mtp", "num_speculative_tokens": tokens}
        args["speculative-config"] = _json(spec)
        origins.derive("roles.prefill.args.speculative-config", where["speculative_tokens"])
    return {"engine": "vllm", "args": args}


def _decode(value: dict[str, Any], where: dict[str, str], origins: Origins) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": value["model_profile"],
        "model-weights-dir": value["weights_dir"],
        "max-seq-len": value["max_seq_len"],
        "kv-cache-dtype": value["kv_cache_dtype"],
        "transport": value["transport"],
    }
    for new, old in (
        ("model", "model_profile"),
        ("model-weights-dir", "weights_dir"),
        ("max-seq-len", "max_seq_len"),
        ("kv-cache-dtype", "kv_cache_dtype"),
        ("transport", "transport"),
        ("with-mtp", "with_mtp"),
    ):
        origins.derive(f"roles.decode.args.{new}", where[old])
    with_mtp = value["with_mtp"]
    if not isinstance(with_mtp, bool):
        _refuse(
            origins,
            where["with_mtp"],
            f"expected true or false, got {with_mtp!r}",
            "write with_mtp: true or false (schema 2: roles.decode.args.with-mtp)",
        )
    elif with_mtp:
        args["with-mtp"] = True
    return {"engine": "tilert", "args": args}


def _role_config(config: dict[str, Any], role: str, args: dict[str, Any], origins: Origins) -> None:
    extra = config.get(role)
    if extra is None:
        return
    path = f"backend.tilert_config.{role}"
    if not isinstance(extra, dict):
        _refuse(origins, path, f"expected a mapping of {role} flags", f"write {role}: {{flag: v}}")
        return
    for key, item in extra.items():
        flag = str(key).lstrip("-").replace("_", "-")
        if flag in _FORK_MANAGED[role]:
            _refuse(
                origins,
                f"{path}.{key}",
                f"'{key}' is managed by srtctl schema 1 (TileRT config cannot override "
                "srtctl-managed arguments)",
                f"set it through its backend key, or migrate (tilert-submit migrate) and set "
                f"roles.{role}.args.{flag}",
            )
            continue
        args[key] = item
        origins.note(f"roles.{role}.args.{key}", f"{path}.{key}")


def _convert(raw: dict[str, Any], value: dict[str, Any], origins: Origins) -> dict[str, Any]:
    """The fork converts model.path into weights_dir (once, under a lock) before any worker."""
    source = _mapping(raw, "model").get("path")
    convert: dict[str, Any] = {}
    if source is not None:
        convert["source"] = source
        origins.derive("roles.decode.convert.source", "model.path")
    convert["model_type"] = value["weight_model_type"]
    origins.derive("roles.decode.convert", "backend.weight_model_type")
    origins.derive("roles.decode.convert.model_type", "backend.weight_model_type")
    return convert


def _frontend(raw: dict[str, Any], origins: Origins) -> Any:
    frontend = raw.get("frontend")
    if frontend is None:
        frontend = {}
    if not isinstance(frontend, dict):
        origins.note("frontend", "frontend")
        return frontend
    frontend = dict(frontend)
    origins.note("frontend", "frontend")
    args = frontend.get("args")
    args = dict(args) if isinstance(args, dict) else args
    if isinstance(args, dict):
        for key in list(args):
            if str(key).lstrip("-").replace("_", "-") == "model-path":
                _refuse(
                    origins,
                    f"frontend.args.{key}",
                    "schema 1 sets the router's --model-path from model.path",
                    "remove it (or migrate and set frontend.args.model-path)",
                )
                del args[key]
        path = _mapping(raw, "model").get("path")
        if isinstance(path, str):
            args["model-path"] = path
            origins.derive("frontend.args.model-path", "model.path")
        frontend["args"] = args
    elif args is None:
        path = _mapping(raw, "model").get("path")
        if isinstance(path, str):
            frontend["args"] = {"model-path": path}
            origins.derive("frontend.args.model-path", "model.path")
    return frontend


def _identity(raw: dict[str, Any], out: dict[str, Any], origins: Origins) -> None:
    identity = raw.get("identity")
    if identity is None:
        return
    if not isinstance(identity, dict):
        _refuse(origins, "identity", "expected a mapping", "write identity: {frameworks: {...}}")
        return
    for key, item in identity.items():
        if key == "frameworks":
            agent = out.setdefault("agent", {})
            if isinstance(agent, dict):
                agent["frameworks"] = item
            origins.note("agent.frameworks", "identity.frameworks")
        elif key in ("model", "container"):
            origins.problems.append(
                warning(
                    f"identity.{key}",
                    f"identity.{key} is informational in srtctl (compared after health, never "
                    "enforced); tilert-agent does not compare it",
                    f"remove identity.{key}; the version pins (identity.frameworks) are checked",
                )
            )
        else:
            _refuse(
                origins,
                f"identity.{key}",
                f"unknown key '{key}'",
                "keys allowed under identity: model, container, frameworks",
            )


def _dynamo(raw: dict[str, Any], origins: Origins) -> None:
    dynamo = raw.get("dynamo")
    if dynamo is None:
        return
    if isinstance(dynamo, dict) and dynamo.get("install") is False and len(dynamo) == 1:
        return  # what a TileRT recipe says: no Dynamo wheel; tilert-agent installs none
    _refuse(
        origins,
        "dynamo",
        "tilert-agent runs no Dynamo: only 'dynamo: {install: false}' has a meaning here",
        "write dynamo: {install: false}, or remove dynamo (schema 2: nothing)",
    )


def _srun_options(raw: dict[str, Any], out: dict[str, Any], origins: Origins) -> None:
    options = raw.get("srun_options")
    if options is None:
        return
    if not isinstance(options, dict):
        _refuse(origins, "srun_options", "expected a mapping", "write container-writable: ''")
        return
    flags: list[str] = []
    for key, item in options.items():
        name = str(key).lstrip("-")
        path = f"srun_options.{key}"
        if name not in PYXIS_FLAGS:
            _refuse(
                origins,
                path,
                f"'{key}' is not a pyxis container flag: tilert-agent renders its own srun steps",
                f"remove it (pyxis flags it passes on: {', '.join(PYXIS_FLAGS)}; schema 2: "
                "agent.pyxis_flags)",
            )
        elif item not in ("", None, True):
            _refuse(
                origins,
                path,
                f"--{name} takes no value, got {item!r}",
                f'write {name}: "" (schema 2: agent.pyxis_flags: [--{name}])',
            )
        else:
            flags.append(f"--{name}")
            origins.derive(f"agent.pyxis_flags[{len(flags) - 1}]", path)
    if flags:
        agent = out.setdefault("agent", {})
        if isinstance(agent, dict):
            agent["pyxis_flags"] = flags
        origins.derive("agent.pyxis_flags", "srun_options")


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))
