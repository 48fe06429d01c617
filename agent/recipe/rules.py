"""Load-time rules: srtctl's, srtctl's late failures moved before sbatch, and P/D agreement.

TileRT checks that prefill and decode agree only at the first request's handshake, and a mismatch
shows as a 120 s timeout then, hours after sbatch. Everything here is known from the recipe alone,
so it is checked before anything is submitted (and again by every agent on its node).

Arg keys are compared with ``_`` == ``-``; problems name the key as the user wrote it. Keys inside
``kv-transfer-config`` are named after it:
``roles.prefill.args.kv-transfer-config.kv_connector_extra_config.tilert_transport``.

KV cache dtype pairs (TileRT 0.1.6 derives its layout version on the prefill from vLLM's real KV
cache and on the decode from ``--kv-cache-dtype``; both must land on the same layout):

======================================  ===========================================  ==========
vLLM prefill ``kv-cache-dtype``          TileRT decode ``kv-cache-dtype``             layout
======================================  ===========================================  ==========
``fp8_ds_mla``                          ``fp8_ds_mla`` (decode default), ``fp8``,    fp8 MLA
                                        ``fp8_e4m3``
``auto`` (vLLM default), ``bfloat16``,  ``bf16``, ``bfloat16``, ``auto``             bf16 (+40)
``bf16``
``fp8``, ``fp8_e4m3`` (ROCm)            ``fp8_rocm``                                 ROCm fp8
======================================  ===========================================  ==========

With neither side set, vLLM's ``auto`` (bf16 for GLM-5 checkpoints) meets TileRT's default
``fp8_ds_mla``: a mismatch, reported. vLLM's ``fp8`` on NVIDIA is not the ``fp8_ds_mla`` layout.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

from agent.facts import (
    CONNECTOR,
    CONNECTOR_MODULE,
    CONNECTOR_ROLE,
    DECODE_ENGINE,
    DECODE_FOR_LAYOUT,
    DECODE_KV_DEFAULT,
    DECODE_KV_LAYOUT,
    DEFAULT_DECODE_MAX_SEQ_LEN,
    DEFAULT_SENDERS,
    DEFAULT_TILERT_MODEL,
    DEFAULT_TRANSPORT,
    MANAGED_ARGS,
    NUM_MTP_CHOICES,
    PREFILL_ENGINE,
    PREFILL_KV_DEFAULT,
    PREFILL_KV_LAYOUT,
    ROUTER_MANAGED_ARGS,
    ROUTER_PARSERS,
    ROUTER_TYPE,
    TILERT_MODELS,
    TRANSPORTS,
    human_int,
    strict_int,
)
from agent.problems import Problem, error, warning
from agent.recipe.model import (
    ArgValue,
    EnvValue,
    Recipe,
    Role,
    engine_type,
    find_arg,
    gpus_per_node,
    norm_arg,
    role_env,
    role_layout,
)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check(recipe: Recipe, *, launcher: str | None = None) -> list[Problem]:
    """Every load-time rule; ``launcher`` (the cluster's) decides whether images are required."""
    out: list[Problem] = []
    _identity(recipe, out)
    _engines(recipe, out)
    _frontend(recipe, out)
    _topology(recipe, out)
    _managed_args(recipe, out)
    prefill, decode = recipe.roles.prefill, recipe.roles.decode
    if prefill is not None and decode is not None:
        _agreement(recipe, prefill, decode, out)
    _model(recipe, out)
    _images(recipe, launcher, out)
    _settings(recipe, out)
    return out


# ---- helpers ----------------------------------------------------------------------------------


def _arg(role: Role, name: str) -> tuple[str, ArgValue] | None:
    return find_arg(role.args, name)


def _json_arg(
    role: Role, role_name: str, name: str, out: list[Problem]
) -> tuple[str, dict[str, Any] | None] | None:
    """(path, parsed object) of a JSON-valued arg (a string or a mapping); None when absent."""
    found = _arg(role, name)
    if found is None:
        return None
    key, value = found
    path = f"roles.{role_name}.args.{key}"
    if isinstance(value, dict):
        return path, value
    if not isinstance(value, str):
        out.append(error(path, "expected a JSON object (a string or a mapping)", _json_hint(name)))
        return path, None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        out.append(
            error(path, f"is not valid JSON: {exc.msg} at character {exc.pos}", _json_hint(name))
        )
        return path, None
    if not isinstance(parsed, dict):
        out.append(error(path, "must be a JSON object", _json_hint(name)))
        return path, None
    return path, parsed


def _json_hint(name: str) -> str:
    if name == "kv-transfer-config":
        return (
            "write it as a mapping, or a quoted JSON string like "
            f'\'{{"kv_connector":"{CONNECTOR}","kv_connector_module_path":"{CONNECTOR_MODULE}",'
            f'"kv_role":"{CONNECTOR_ROLE}","kv_connector_extra_config":{{...}}}}\''
        )
    return (
        "write a mapping, or a quoted JSON string like "
        '\'{"method":"mtp","num_speculative_tokens":1}\''
    )


def _env_str(value: EnvValue | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _env_path(recipe: Recipe, name: str, roles: list[tuple[str, Role]]) -> str:
    for role_name, role in roles:
        if name in role.env:
            return f"roles.{role_name}.env.{name}"
    return f"environment.{name}"


def is_hub_id(value: str) -> bool:
    """Whether a model location is a hub id rather than a local path."""
    return not value.startswith(("/", "./", "../", "~"))


# ---- rules ------------------------------------------------------------------------------------


def _identity(recipe: Recipe, out: list[Problem]) -> None:
    if not recipe.name:
        out.append(
            error(
                "name",
                "the recipe has no name (it names the job directory and the Slurm job)",
                "add name: my-job",
            )
        )
    elif not _NAME.match(recipe.name):
        out.append(
            error(
                "name",
                f"'{recipe.name}' is not a usable job name",
                "use letters, digits, '.', '_' and '-' only, starting with a letter or digit",
            )
        )
    if recipe.schema is not None and recipe.schema != 2:
        out.append(
            error(
                "schema",
                f"schema {recipe.schema} is not supported; tilert-agent reads srtctl schema 2",
                "set schema: 2 (run `srtctl migrate` on a schema 1 recipe first)",
            )
        )


def _roles(recipe: Recipe) -> list[tuple[str, Role]]:
    roles = [("prefill", recipe.roles.prefill), ("decode", recipe.roles.decode)]
    return [(name, role) for name, role in roles if role is not None]


def _engines(recipe: Recipe, out: list[Problem]) -> None:
    roles = _roles(recipe)
    fix = (
        f"remove the top-level engine; set roles.prefill.engine: {PREFILL_ENGINE} and "
        f"roles.decode.engine: {DECODE_ENGINE}"
    )
    if recipe.engine is not None:
        with_role = [name for name, role in roles if role.engine is not None]
        if with_role:
            message = (
                "a top-level engine cannot be combined with "
                + ", ".join(f"roles.{name}.engine" for name in with_role)
                + " (srtctl rejects this even when the types match)"
            )
        else:
            message = "one engine for every role cannot serve vLLM prefill + TileRT decode"
        out.append(error("engine", message, fix))
        return
    for name, role in roles:
        want = PREFILL_ENGINE if name == "prefill" else DECODE_ENGINE
        path = f"roles.{name}.engine"
        if role.engine is None:
            out.append(
                error(
                    path,
                    "every role needs an engine when there is no top-level engine",
                    f"add engine: {want} to roles.{name}",
                )
            )
            continue
        kind = engine_type(role.engine)
        if kind is None:
            out.append(
                error(path, "an engine mapping needs a string 'type'", f"write engine: {want}")
            )
            continue
        if kind != want:
            what = "vLLM prefill" if name == "prefill" else "a TileRT decode engine"
            out.append(
                error(
                    path,
                    f"{ROUTER_TYPE} needs {what}; got engine type '{kind}'",
                    f"set {path}: {want}",
                )
            )
        if isinstance(role.engine, dict):
            for key in role.engine:
                if key not in ("type", "served_model_name"):
                    out.append(
                        warning(
                            f"{path}.{key}",
                            "engine options other than 'type' are not used by tilert-agent",
                            f"remove it; engine flags go under roles.{name}.args",
                        )
                    )


def _frontend(recipe: Recipe, out: list[Problem]) -> None:
    frontend = recipe.frontend
    if frontend.type is None:
        out.append(
            error(
                "frontend.type",
                "no frontend type (srtctl's default is dynamo, which tilert-agent does not run)",
                f"set frontend.type: {ROUTER_TYPE}",
            )
        )
    elif frontend.type != ROUTER_TYPE:
        out.append(
            error(
                "frontend.type",
                f"frontend type '{frontend.type}' is not served by tilert-agent: it runs TileRT's "
                "P/D router only (Dynamo, sglang-router, vllm-router and direct frontends are "
                "srtctl's)",
                f"set frontend.type: {ROUTER_TYPE}",
            )
        )
    if frontend.enable_multiple_frontends:
        out.append(
            error(
                "frontend.enable_multiple_frontends",
                f"{ROUTER_TYPE} runs one router (decode busy state lives in that process)",
                "set frontend.enable_multiple_frontends: false",
            )
        )
    for key in frontend.args:
        why = ROUTER_MANAGED_ARGS.get(norm_arg(key))
        if why is not None:
            out.append(error(f"frontend.args.{key}", f"{why}; it cannot be set", "remove it"))
    model_path = find_arg(frontend.args, "model-path")
    if model_path is None:
        out.append(
            error(
                "frontend.args.model-path",
                "the router needs the tokenizer and generation_config.json (streaming fails "
                "mid-stream without it, also with parser: none)",
                "set frontend.args.model-path to the model folder as the router sees it "
                "(e.g. /model, or the same path as model.path)",
            )
        )
    else:
        key, value = model_path
        path = f"frontend.args.{key}"
        if not isinstance(value, str) or not value:
            out.append(error(path, "expected a path", "write a folder path"))
        elif is_hub_id(value):
            out.append(
                warning(
                    path,
                    f"'{value}' looks like a hub id: the router downloads it when it starts, and "
                    "compute nodes without internet access fail then",
                    "download the model once and point model-path at the folder (absolute, or "
                    "./ relative to the recipe)",
                )
            )
    parser = find_arg(frontend.args, "parser")
    if parser is None:
        out.append(
            warning(
                "frontend.args.parser",
                "not set: the router's default glm47 parser needs vLLM installed in the router "
                "image",
                "set parser: none, or parser: glm47 when the router image has vLLM",
            )
        )
    elif parser[1] not in ROUTER_PARSERS:
        out.append(
            error(
                f"frontend.args.{parser[0]}",
                f"the router accepts parser {' or '.join(ROUTER_PARSERS)}, not {parser[1]!r}",
                "set parser: none (or glm47)",
            )
        )


def _topology(recipe: Recipe, out: list[Problem]) -> None:
    node_gpus = gpus_per_node(recipe)
    if recipe.resources.gpus_per_node is not None and recipe.resources.gpus_per_node < 1:
        out.append(error("resources.gpus_per_node", "must be at least 1", "write e.g. 8"))
    for name in ("agg", "aggregated"):
        if getattr(recipe.roles, name) is not None:
            out.append(
                error(
                    f"roles.{name}",
                    "aggregated workers are not supported: tilert-router serves one vLLM "
                    "prefill and TileRT decode workers",
                    f"remove roles.{name}; use roles.prefill and roles.decode",
                )
            )
    prefill, decode = recipe.roles.prefill, recipe.roles.decode
    if prefill is None:
        out.append(error("roles.prefill", "a vLLM prefill role is required", "add roles.prefill"))
    else:
        nodes, workers, gpus = role_layout(prefill, node_gpus)
        if workers != 1:
            out.append(
                error(
                    "roles.prefill.workers",
                    f"{ROUTER_TYPE} needs exactly one prefill worker (got {workers})",
                    "set roles.prefill.workers: 1",
                )
            )
        if nodes > 1:
            out.append(
                error(
                    "roles.prefill.nodes",
                    "a prefill on more than one node is not supported yet (vLLM would expose one "
                    "API per node, and the router takes one)",
                    "set roles.prefill.nodes: 1 and use tensor parallelism inside the node",
                )
            )
        elif nodes < 1:
            out.append(error("roles.prefill.nodes", "must be 1", "set roles.prefill.nodes: 1"))
        _gpus_fit("prefill", gpus, node_gpus, out)
    if decode is None:
        out.append(error("roles.decode", "a TileRT decode role is required", "add roles.decode"))
    else:
        nodes, workers, gpus = role_layout(decode, node_gpus)
        if workers < 1:
            out.append(
                error(
                    "roles.decode.workers",
                    f"{ROUTER_TYPE} needs at least one decode worker",
                    "set roles.decode.workers: 1 (or more)",
                )
            )
        elif nodes != workers:
            out.append(
                error(
                    "roles.decode.nodes",
                    f"decode nodes ({nodes}) must equal decode workers ({workers}): one agent "
                    "and one TileRT decode server per node, and a decode worker cannot span nodes",
                    f"set roles.decode.nodes: {workers}",
                )
            )
        _gpus_fit("decode", gpus, node_gpus, out)


def _gpus_fit(name: str, gpus: int, node_gpus: int, out: list[Problem]) -> None:
    if gpus > node_gpus:
        out.append(
            error(
                f"roles.{name}.gpus",
                f"a {name} worker must fit on one node: {gpus} GPUs per worker > "
                f"gpus_per_node {node_gpus}",
                f"set roles.{name}.gpus to at most {node_gpus}",
            )
        )
    elif gpus < 0:
        # 0 is a CPU-only engine (the --mock stand-ins, vLLM's CPU backend): no GPU is requested.
        out.append(error(f"roles.{name}.gpus", "must not be negative", f"set it to {node_gpus}"))


def _managed_args(recipe: Recipe, out: list[Problem]) -> None:
    for name, role in _roles(recipe):
        for key in role.args:
            managed = MANAGED_ARGS.get((name, norm_arg(key)))
            if managed is not None:
                why, fix = managed
                out.append(error(f"roles.{name}.args.{key}", why, fix))


def _agreement(recipe: Recipe, prefill: Role, decode: Role, out: list[Problem]) -> None:
    kv = _json_arg(prefill, "prefill", "kv-transfer-config", out)
    if kv is None:
        out.append(
            error(
                "roles.prefill.args.kv-transfer-config",
                "vLLM needs TileRT's KV connector to hand the KV cache to the decode nodes",
                _json_hint("kv-transfer-config"),
            )
        )
        kv_path, connector = "roles.prefill.args.kv-transfer-config", None
    else:
        kv_path, connector = kv
    extra: dict[str, Any] = {}
    extra_path = f"{kv_path}.kv_connector_extra_config"
    if connector is not None:
        for field, want in (
            ("kv_connector", CONNECTOR),
            ("kv_connector_module_path", CONNECTOR_MODULE),
            ("kv_role", CONNECTOR_ROLE),
        ):
            got = connector.get(field)
            if got != want:
                told = "is missing" if got is None else f"is {got!r}"
                out.append(
                    error(
                        f"{kv_path}.{field}",
                        f"{told}; TileRT needs {want!r}",
                        f'set "{field}": "{want}"',
                    )
                )
        raw_extra = connector.get("kv_connector_extra_config", {})
        if isinstance(raw_extra, dict):
            extra = raw_extra
        else:
            out.append(
                error(
                    extra_path, "must be a JSON object", 'write "kv_connector_extra_config": {...}'
                )
            )
    _transport(decode, extra, extra_path, out)
    _seq_len(prefill, decode, extra, extra_path, out)
    _tilert_model(decode, extra, extra_path, out)
    host = extra.get("tilert_host")
    if host is not None and not _bare_ipv4(host):
        out.append(
            error(
                f"{extra_path}.tilert_host",
                f"{host!r} is not a bare IPv4 address",
                "write a dotted IPv4 address without brackets or port, or remove it (the router "
                "sends each decode node's address per request)",
            )
        )
    _kv_dtype(prefill, decode, out)
    tokens = _arg(prefill, "return-tokens-as-token-ids")
    if tokens is None or tokens[1] is not True:
        key = tokens[0] if tokens else "return-tokens-as-token-ids"
        out.append(
            error(
                f"roles.prefill.args.{key}",
                "the router reads the first token from a 'token_id:N' logprob, so vLLM needs "
                "--return-tokens-as-token-ids",
                f"set roles.prefill.args.{key}: true",
            )
        )
    _mtp(prefill, decode, out)
    _env_agreement(recipe, prefill, decode, out)
    _served_name(prefill, decode, out)


def _transport(decode: Role, extra: dict[str, Any], extra_path: str, out: list[Problem]) -> None:
    pre = extra.get("tilert_transport")
    dec = _arg(decode, "transport")
    dec_value = dec[1] if dec else None
    if pre is not None and pre not in TRANSPORTS:
        out.append(
            error(
                f"{extra_path}.tilert_transport",
                f"unknown transport {pre!r}",
                f"use {' or '.join(TRANSPORTS)}",
            )
        )
        return
    if dec is not None and dec_value not in TRANSPORTS:
        out.append(
            error(
                f"roles.decode.args.{dec[0]}",
                f"unknown transport {dec_value!r}",
                f"use {' or '.join(TRANSPORTS)}",
            )
        )
        return
    pre_eff = pre or DEFAULT_TRANSPORT
    dec_eff = dec_value or DEFAULT_TRANSPORT
    if pre_eff != dec_eff:
        out.append(
            error(
                f"{extra_path}.tilert_transport",
                f"prefill transport {pre_eff!r}{'' if pre else ' (default)'} differs from decode "
                f"transport {dec_eff!r}{'' if dec else ' (default)'}",
                f"use the same transport on both sides: tilert_transport here and "
                f"roles.decode.args.transport (TileRT's default is {DEFAULT_TRANSPORT} on both)",
            )
        )


def _seq_len(
    prefill: Role, decode: Role, extra: dict[str, Any], extra_path: str, out: list[Problem]
) -> None:
    path = f"{extra_path}.tilert_max_seq_len"
    dec = _arg(decode, "max-seq-len")
    dec_len = DEFAULT_DECODE_MAX_SEQ_LEN
    if dec is not None:
        parsed = strict_int(dec[1])
        if parsed is None or parsed < 1:
            out.append(
                error(
                    f"roles.decode.args.{dec[0]}",
                    "must be a positive integer",
                    "write e.g. max-seq-len: 202752",
                )
            )
            return
        dec_len = parsed
    mml_arg = _arg(prefill, "max-model-len")
    mml: int | None = None
    if mml_arg is not None:
        mml = human_int(mml_arg[1])
        if mml is None or mml < 1:
            out.append(
                error(
                    f"roles.prefill.args.{mml_arg[0]}",
                    "must be a positive integer",
                    "write e.g. max-model-len: 202752",
                )
            )
            return
    raw = extra.get("tilert_max_seq_len")
    tms: int | None = None
    if raw is not None:
        tms = strict_int(raw)
        if tms is None or tms < 1:
            out.append(
                error(path, "must be a positive integer", f'write "tilert_max_seq_len": {dec_len}')
            )
            return
    effective = tms if tms is not None else mml
    if effective is None:
        out.append(
            error(
                path,
                "the prefill's sequence limit is unknown: neither tilert_max_seq_len nor "
                "roles.prefill.args.max-model-len is set (TileRT then uses vLLM's model default)",
                f"set tilert_max_seq_len and max-model-len to the decode max-seq-len ({dec_len})",
            )
        )
        return
    if effective != dec_len:
        told = (
            "tilert_max_seq_len" if tms is not None else "tilert_max_seq_len (from max-model-len)"
        )
        out.append(
            error(
                path,
                f"{told} {effective} differs from the decode max-seq-len {dec_len}"
                f"{'' if dec else ' (TileRT default)'}",
                "use the same value on both sides",
            )
        )
    if mml is not None and effective > mml:
        out.append(
            error(
                path,
                f"tilert_max_seq_len {effective} exceeds the prefill max-model-len {mml}",
                "make it at most max-model-len",
            )
        )


def _tilert_model(decode: Role, extra: dict[str, Any], extra_path: str, out: list[Problem]) -> None:
    dec = _arg(decode, "model")
    dec_model = dec[1] if dec else DEFAULT_TILERT_MODEL
    if dec_model not in TILERT_MODELS:
        out.append(
            error(
                f"roles.decode.args.{dec[0] if dec else 'model'}",
                f"{dec_model!r} is not a TileRT model profile",
                f"use one of {', '.join(TILERT_MODELS)}",
            )
        )
        return
    pre = extra.get("tilert_model", DEFAULT_TILERT_MODEL)
    if pre != dec_model:
        out.append(
            error(
                f"{extra_path}.tilert_model",
                f"prefill profile {pre!r}{'' if 'tilert_model' in extra else ' (default)'} differs "
                f"from the decode model {dec_model!r}{'' if dec else ' (default)'}",
                "use the same profile on both sides (glm5: GLM-5/5.1, glm5_2: GLM-5.2/5.3, dsv32)",
            )
        )


def _bare_ipv4(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        return False
    return True


def _kv_dtype(prefill: Role, decode: Role, out: list[Problem]) -> None:
    pre = _arg(prefill, "kv-cache-dtype")
    dec = _arg(decode, "kv-cache-dtype")
    pre_value = pre[1] if pre else PREFILL_KV_DEFAULT
    dec_value = dec[1] if dec else DECODE_KV_DEFAULT
    pre_path = f"roles.prefill.args.{pre[0] if pre else 'kv-cache-dtype'}"
    dec_path = f"roles.decode.args.{dec[0] if dec else 'kv-cache-dtype'}"
    pre_layout = PREFILL_KV_LAYOUT.get(str(pre_value))
    dec_layout = DECODE_KV_LAYOUT.get(str(dec_value))
    if pre_layout is None:
        out.append(
            error(
                pre_path,
                f"KV cache dtype {pre_value!r} has no TileRT layout",
                f"use one of {', '.join(PREFILL_KV_LAYOUT)}",
            )
        )
    if dec_layout is None:
        out.append(
            error(
                dec_path,
                f"TileRT decode does not accept KV cache dtype {dec_value!r}",
                f"use one of {', '.join(DECODE_KV_LAYOUT)}",
            )
        )
    if pre_layout is None or dec_layout is None or pre_layout == dec_layout:
        return
    out.append(
        error(
            dec_path,
            f"prefill KV cache dtype {pre_value!r}{'' if pre else ' (vLLM default)'} is the "
            f"{pre_layout} layout but decode {dec_value!r}{'' if dec else ' (TileRT default)'} is "
            f"the {dec_layout} layout",
            f"set {dec_path}: {DECODE_FOR_LAYOUT[pre_layout]} to match the prefill (pairs: "
            "fp8_ds_mla/fp8, bfloat16/bf16, ROCm fp8/fp8_rocm)",
        )
    )


def _is_mtp(method: Any) -> bool:
    return isinstance(method, str) and (method == "mtp" or method.endswith("_mtp"))


def _mtp(prefill: Role, decode: Role, out: list[Problem]) -> None:
    spec = _json_arg(prefill, "prefill", "speculative-config", out)
    if spec is not None and spec[1] is None:
        return
    prefill_mtp = spec is not None and spec[1] is not None and _is_mtp(spec[1].get("method"))
    with_mtp = _arg(decode, "with-mtp")
    decode_mtp = with_mtp is not None and with_mtp[1] is True
    if decode_mtp and not prefill_mtp:
        out.append(
            error(
                f"roles.decode.args.{with_mtp[0] if with_mtp else 'with-mtp'}",
                "decode runs with --with-mtp but the prefill has no MTP speculative-config "
                "(TileRT then waits for an MTP layer the prefill never sends)",
                'add speculative-config: \'{"method":"mtp","num_speculative_tokens":1}\' to '
                "roles.prefill.args, or remove with-mtp",
            )
        )
    elif prefill_mtp and not decode_mtp:
        path = spec[0] if spec else "roles.prefill.args.speculative-config"
        out.append(
            error(
                path,
                "the prefill uses MTP speculative decoding but the decode has no --with-mtp",
                "add with-mtp: true to roles.decode.args, or remove speculative-config",
            )
        )
    num = _arg(decode, "num-mtp")
    if num is not None and strict_int(num[1]) not in NUM_MTP_CHOICES:
        out.append(
            error(
                f"roles.decode.args.{num[0]}",
                f"TileRT 0.1.6 accepts num-mtp {', '.join(map(str, NUM_MTP_CHOICES))} only",
                "set num-mtp: 3 or remove it",
            )
        )


def _env_agreement(recipe: Recipe, prefill: Role, decode: Role, out: list[Problem]) -> None:
    pre_env, dec_env = role_env(recipe, prefill), role_env(recipe, decode)
    both = [("decode", decode), ("prefill", prefill)]
    senders_p = _env_str(pre_env.get("TILERT_PD_SENDERS")) or str(DEFAULT_SENDERS)
    senders_d = _env_str(dec_env.get("TILERT_PD_SENDERS")) or str(DEFAULT_SENDERS)
    path = _env_path(recipe, "TILERT_PD_SENDERS", both)
    senders: int | None = None
    if senders_p != senders_d:
        out.append(
            error(
                path,
                f"TILERT_PD_SENDERS differs: prefill {senders_p}, decode {senders_d}",
                "set it once in the top-level environment, or to the same value in both roles",
            )
        )
    elif not senders_p.isdigit() or int(senders_p) < 1:
        out.append(
            error(
                path, f"TILERT_PD_SENDERS {senders_p!r} is not a positive integer", 'write e.g. "8"'
            )
        )
    else:
        senders = int(senders_p)
    no_mtp_p = _env_str(pre_env.get("TILERT_PD_NO_MTP"))
    no_mtp_d = _env_str(dec_env.get("TILERT_PD_NO_MTP"))
    if no_mtp_p != no_mtp_d:
        out.append(
            error(
                _env_path(recipe, "TILERT_PD_NO_MTP", both),
                f"TILERT_PD_NO_MTP differs: prefill {no_mtp_p or 'unset'}, "
                f"decode {no_mtp_d or 'unset'}",
                "set it once in the top-level environment, or identically in both roles",
            )
        )
    if senders is None:
        return
    tp = _arg(prefill, "tensor-parallel-size")
    tp_value = strict_int(tp[1]) if tp else 1
    tp_path = f"roles.prefill.args.{tp[0] if tp else 'tensor-parallel-size'}"
    if tp_value is None or tp_value < 1:
        out.append(
            error(tp_path, "must be a positive integer", "write e.g. tensor-parallel-size: 8")
        )
    elif tp_value < senders:
        out.append(
            error(
                tp_path,
                f"prefill tensor parallelism {tp_value}{'' if tp else ' (vLLM default)'} does not "
                f"cover TILERT_PD_SENDERS={senders} sender ranks",
                f"set tensor-parallel-size to at least {senders} (or lower TILERT_PD_SENDERS on "
                "both sides)",
            )
        )


def _served_name(prefill: Role, decode: Role, out: list[Problem]) -> None:
    pre = _arg(prefill, "served-model-name")
    pre_name = pre[1] if pre else None
    candidates: list[tuple[str, Any]] = []
    found = _arg(decode, "served-model-name")
    if found is not None:
        candidates.append((f"roles.decode.args.{found[0]}", found[1]))
    if isinstance(decode.engine, dict) and "served_model_name" in decode.engine:
        candidates.append(
            ("roles.decode.engine.served_model_name", decode.engine["served_model_name"])
        )
    for path, value in candidates:
        if value != pre_name:
            out.append(
                error(
                    path,
                    f"decode model name {value!r} conflicts with the prefill served-model-name "
                    f"{pre_name!r} (clients use the prefill's name)",
                    "remove it; the public name is roles.prefill.args.served-model-name",
                )
            )
        else:
            out.append(
                warning(
                    path,
                    "TileRT decode takes no served-model-name; tilert-agent does not pass it",
                    "remove it; the public name is roles.prefill.args.served-model-name",
                )
            )


def _model(recipe: Recipe, out: list[Problem]) -> None:
    path = recipe.model.path
    if not path:
        out.append(
            error(
                "model.path",
                "no model: vLLM serves model.path",
                "set model.path to a folder, a cluster model_paths alias, or hf:org/name",
            )
        )
    elif is_hub_id(path):
        out.append(
            warning(
                "model.path",
                f"'{path}' is a hub id: vLLM downloads it on the prefill node when it starts, and "
                "compute nodes without internet access fail then",
                "download it once and use its folder or a cluster model_paths alias",
            )
        )


def _images(recipe: Recipe, launcher: str | None, out: list[Problem]) -> None:
    # Only the pyxis launcher runs images; the process launcher (and an unknown launcher, when a
    # node re-checks an already resolved recipe) has nothing to require.
    if launcher != "pyxis":
        return
    shared = recipe.model.container
    for name, role in _roles(recipe):
        if not (role.container or shared):
            out.append(
                error(
                    f"roles.{name}.container",
                    f"no image for the {name} engine (the pyxis launcher runs every engine in one)",
                    f"set roles.{name}.container or model.container",
                )
            )
    if not (recipe.frontend.container_image or shared):
        out.append(
            error(
                "frontend.container_image",
                "no image for the router (the pyxis launcher runs it in one)",
                "set frontend.container_image or model.container",
            )
        )


def _settings(recipe: Recipe, out: list[Problem]) -> None:
    hc = recipe.health_check
    if hc.max_attempts is not None and hc.max_attempts < 1:
        out.append(error("health_check.max_attempts", "must be at least 1", "write e.g. 360"))
    if hc.interval_seconds is not None and hc.interval_seconds <= 0:
        out.append(error("health_check.interval_seconds", "must be positive", "write e.g. 10"))
    if recipe.benchmark.type not in (None, "manual"):
        out.append(
            warning(
                "benchmark.type",
                f"tilert-agent runs no benchmark ({recipe.benchmark.type!r} is ignored)",
                "set benchmark.type: manual and run a streaming /v1/chat/completions client "
                "against the router",
            )
        )
    agent = recipe.agent
    ports = [
        ("agent.router_port", agent.router_port),
        ("agent.ports.prefill.http", agent.ports.prefill.http),
        ("agent.ports.prefill.agent", agent.ports.prefill.agent),
        ("agent.ports.decode.http", agent.ports.decode.http),
        ("agent.ports.decode.agent", agent.ports.decode.agent),
        ("agent.ports.decode.ctrl", agent.ports.decode.ctrl),
    ]
    for path, port in ports:
        if port is not None and not 1 <= port <= 65535:
            out.append(error(path, f"{port} is not a TCP port", "use 1-65535"))
    for path, value in (
        ("agent.probe.startup_interval_s", agent.probe.startup_interval_s),
        ("agent.probe.interval_s", agent.probe.interval_s),
        ("agent.probe.timeout_s", agent.probe.timeout_s),
        ("agent.restart.backoff_initial_s", agent.restart.backoff_initial_s),
        ("agent.restart.window_s", agent.restart.window_s),
        ("agent.canary.timeout_s", agent.canary.timeout_s),
    ):
        if value <= 0:
            out.append(error(path, "must be positive", "remove it to use the default"))
    if agent.logs.max_bytes < 1:
        out.append(error("agent.logs.max_bytes", "must be positive", "e.g. 67108864 (64 MiB)"))
    if agent.logs.backups < 0:
        out.append(error("agent.logs.backups", "must be 0 or more", "remove it to keep 3"))
    if not agent.logs.node_dir.startswith("/"):
        out.append(
            error(
                "agent.logs.node_dir",
                f"{agent.logs.node_dir!r} is not an absolute path",
                "name a folder on each node's local disk, e.g. /tmp/tilert-logs",
            )
        )
    prefill = recipe.roles.prefill
    if prefill is not None:
        _, _, gpus = role_layout(prefill, gpus_per_node(recipe))
        tp = _arg(prefill, "tensor-parallel-size")
        pp = _arg(prefill, "pipeline-parallel-size")
        tp_n = strict_int(tp[1]) if tp else 1
        pp_n = strict_int(pp[1]) if pp else 1
        if gpus and tp_n and pp_n and tp_n * pp_n != gpus:
            out.append(
                warning(
                    "roles.prefill.gpus",
                    f"the prefill holds {gpus} GPUs but vLLM uses tensor x pipeline parallel "
                    f"{tp_n} x {pp_n} = {tp_n * pp_n}",
                    "make roles.prefill.gpus equal to tensor-parallel-size x "
                    "pipeline-parallel-size",
                )
            )
