"""The prefill/decode agreements: what TileRT checks only at the first request, checked at load.

TileRT checks that prefill and decode agree only at the first request's handshake, and a mismatch
shows as a 120 s timeout then, hours after sbatch. Everything here is known from the recipe alone:
the KV connector and its extra config, the transport, the sequence limit, the TileRT model profile,
the KV cache layout (the pairs are in ``agent.facts``; with neither side set, vLLM's ``auto`` meets
TileRT's ``fp8_ds_mla``: a mismatch, reported), MTP on both sides or neither, the TileRT
environment, the served name and the connector's host.

Keys inside ``kv-transfer-config`` are named after it:
``roles.prefill.args.kv-transfer-config.kv_connector_extra_config.tilert_transport``.
"""

from __future__ import annotations

from typing import Any

from agent.facts import (
    CONNECTOR,
    CONNECTOR_MODULE,
    CONNECTOR_ROLE,
    DECODE_FOR_LAYOUT,
    DECODE_KV_DEFAULT,
    DECODE_KV_LAYOUT,
    DEFAULT_DECODE_MAX_SEQ_LEN,
    DEFAULT_SENDERS,
    DEFAULT_TILERT_MODEL,
    DEFAULT_TRANSPORT,
    NUM_MTP_CHOICES,
    PREFILL_KV_DEFAULT,
    PREFILL_KV_LAYOUT,
    TILERT_MODELS,
    TRANSPORTS,
    human_int,
    strict_int,
)
from agent.problems import Problem, error, warning
from agent.recipe.model import Recipe, Role, find_arg, role_env
from agent.recipe.rules.values import env_path, env_setting, is_bare_ipv4, json_arg, json_hint


def agreement(recipe: Recipe, prefill: Role, decode: Role, out: list[Problem]) -> None:
    """Every point where prefill and decode must agree (both roles are present)."""
    extra, extra_path = _connector(prefill, out)
    _transport(decode, extra, extra_path, out)
    _seq_len(prefill, decode, extra, extra_path, out)
    _tilert_model(decode, extra, extra_path, out)
    _tilert_host(extra, extra_path, out)
    _kv_dtype(prefill, decode, out)
    _token_ids(prefill, out)
    _mtp(prefill, decode, out)
    _mtp_contradictions(recipe, prefill, decode, out)
    _env_agreement(recipe, prefill, decode, out)
    _served_name(prefill, decode, out)


def _connector(prefill: Role, out: list[Problem]) -> tuple[dict[str, Any], str]:
    """TileRT's KV connector in kv-transfer-config: (its extra config, that config's key path)."""
    kv = json_arg(prefill, "prefill", "kv-transfer-config", out)
    if kv is None:
        out.append(
            error(
                "roles.prefill.args.kv-transfer-config",
                "vLLM needs TileRT's KV connector to hand the KV cache to the decode nodes",
                json_hint("kv-transfer-config"),
            )
        )
        kv_path, connector = "roles.prefill.args.kv-transfer-config", None
    else:
        kv_path, connector = kv
    extra: dict[str, Any] = {}
    extra_path = f"{kv_path}.kv_connector_extra_config"
    if connector is None:
        return extra, extra_path
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
            error(extra_path, "must be a JSON object", 'write "kv_connector_extra_config": {...}')
        )
    return extra, extra_path


def _tilert_host(extra: dict[str, Any], extra_path: str, out: list[Problem]) -> None:
    host = extra.get("tilert_host")
    if host is not None and not is_bare_ipv4(host):
        out.append(
            error(
                f"{extra_path}.tilert_host",
                f"{host!r} is not a bare IPv4 address",
                "write a dotted IPv4 address without brackets or port, or remove it (the router "
                "sends each decode node's address per request)",
            )
        )


def _token_ids(prefill: Role, out: list[Problem]) -> None:
    tokens = find_arg(prefill.args, "return-tokens-as-token-ids")
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


def _transport(decode: Role, extra: dict[str, Any], extra_path: str, out: list[Problem]) -> None:
    pre = extra.get("tilert_transport")
    dec = find_arg(decode.args, "transport")
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
    dec = find_arg(decode.args, "max-seq-len")
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
    mml_arg = find_arg(prefill.args, "max-model-len")
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
    dec = find_arg(decode.args, "model")
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


def _kv_dtype(prefill: Role, decode: Role, out: list[Problem]) -> None:
    pre = find_arg(prefill.args, "kv-cache-dtype")
    dec = find_arg(decode.args, "kv-cache-dtype")
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
    spec = json_arg(prefill, "prefill", "speculative-config", out)
    if spec is not None and spec[1] is None:
        return
    prefill_mtp = spec is not None and spec[1] is not None and _is_mtp(spec[1].get("method"))
    with_mtp = find_arg(decode.args, "with-mtp")
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
    num = find_arg(decode.args, "num-mtp")
    if num is not None and num[1] is not None and not decode_mtp:
        out.append(
            error(
                f"roles.decode.args.{num[0]}",
                "num-mtp sets the MTP depth of a decode that runs --with-mtp, and this one does "
                "not",
                "set with-mtp: true (with the prefill's MTP speculative-config), or remove num-mtp",
            )
        )
    elif num is not None and strict_int(num[1]) not in NUM_MTP_CHOICES:
        out.append(
            error(
                f"roles.decode.args.{num[0]}",
                f"TileRT 0.1.6 accepts num-mtp {', '.join(map(str, NUM_MTP_CHOICES))} only",
                "set num-mtp: 3 or remove it",
            )
        )


def _mtp_contradictions(recipe: Recipe, prefill: Role, decode: Role, out: list[Problem]) -> None:
    """Keys that say MTP where another key turns it off (or where MTP is not set at all)."""
    spec = find_arg(decode.args, "speculative-config")
    if spec is not None:
        # TileRT's decode server has no such flag: MTP is its with-mtp, the draft is vLLM's.
        out.append(
            error(
                f"roles.decode.args.{spec[0]}",
                "speculative-config is vLLM's flag (the prefill's); TileRT's decode server has "
                "none, and turns MTP on with with-mtp",
                "move speculative-config to roles.prefill.args and set with-mtp: true in "
                "roles.decode.args, or remove it to run without MTP",
            )
        )
    with_mtp = find_arg(decode.args, "with-mtp")
    if with_mtp is None or with_mtp[1] is not True:
        return
    both = [("decode", decode), ("prefill", prefill)]
    no_mtp = env_setting(role_env(recipe, decode), "TILERT_PD_NO_MTP")
    if no_mtp == "1":
        # glm5 then expects 78 MLA layers and the prefill's MTP draft sends 79: a startup failure.
        out.append(
            error(
                env_path("TILERT_PD_NO_MTP", both),
                f"TILERT_PD_NO_MTP=1 turns TileRT's MTP layer off, and "
                f"roles.decode.args.{with_mtp[0]}: true turns it on",
                "remove TILERT_PD_NO_MTP to run with MTP, or remove with-mtp (and the prefill's "
                "MTP speculative-config) to run without",
            )
        )


def _env_agreement(recipe: Recipe, prefill: Role, decode: Role, out: list[Problem]) -> None:
    pre_env, dec_env = role_env(recipe, prefill), role_env(recipe, decode)
    both = [("decode", decode), ("prefill", prefill)]
    senders_p = env_setting(pre_env, "TILERT_PD_SENDERS") or str(DEFAULT_SENDERS)
    senders_d = env_setting(dec_env, "TILERT_PD_SENDERS") or str(DEFAULT_SENDERS)
    path = env_path("TILERT_PD_SENDERS", both)
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
    no_mtp_p = env_setting(pre_env, "TILERT_PD_NO_MTP")
    no_mtp_d = env_setting(dec_env, "TILERT_PD_NO_MTP")
    if no_mtp_p != no_mtp_d:
        out.append(
            error(
                env_path("TILERT_PD_NO_MTP", both),
                f"TILERT_PD_NO_MTP differs: prefill {no_mtp_p or 'unset'}, "
                f"decode {no_mtp_d or 'unset'}",
                "set it once in the top-level environment, or identically in both roles",
            )
        )
    if senders is None:
        return
    tp = find_arg(prefill.args, "tensor-parallel-size")
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
    pre = find_arg(prefill.args, "served-model-name")
    pre_name = pre[1] if pre else None
    candidates: list[tuple[str, Any]] = []
    found = find_arg(decode.args, "served-model-name")
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
