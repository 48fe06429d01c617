"""Load-time rules for ``roles.decode.convert``: the weights conversion agrees with the decode.

The converter's ``--model_type`` must be the one of the decode's model profile (a glm-5 folder
served as ``dsv32`` loads garbage, an hour later), ``append_mtp`` only means something to a decode
that runs ``--with-mtp``, and the folder the agent converts into must be known, absolute, and not
the checkpoint itself (replacing an incomplete folder deletes what is in it). Every problem names
its key.
"""

from __future__ import annotations

import posixpath

from agent.facts import CONVERTER_MODEL_TYPES, DEFAULT_TILERT_MODEL, TILERT_MODELS
from agent.problems import Problem, error, warning
from agent.recipe.model import Convert, Recipe, Role, find_arg
from agent.recipe.rules.values import program_path

CONVERT = "roles.decode.convert"


def conversion(recipe: Recipe, out: list[Problem]) -> None:
    """Every problem of the ``convert`` keys (the budgets are in range already: their types)."""
    for name in ("prefill", "agg", "aggregated"):
        role: Role | None = getattr(recipe.roles, name)
        if role is not None and role.convert is not None:
            out.append(
                error(
                    f"roles.{name}.convert",
                    "only the TileRT decode serves converted weights",
                    f"move it to {CONVERT}",
                )
            )
    decode = recipe.roles.decode
    if decode is not None and decode.convert is not None:
        _decode_convert(decode, decode.convert, out)


def _weights_dir(decode: Role, out: list[Problem]) -> str | None:
    found = find_arg(decode.args, "model-weights-dir")
    if found is None or not found[1]:
        out.append(
            error(
                "roles.decode.args.model-weights-dir",
                f"{CONVERT} converts into the decode's weights folder, and none is set",
                "set model-weights-dir to the folder the converted weights go to (it may not "
                "exist yet)",
            )
        )
        return None
    key, value = found
    if not isinstance(value, str) or not posixpath.isabs(value):
        out.append(
            error(
                f"roles.decode.args.{key}",
                f"{value!r} is not an absolute path; the agent converts into it and replaces it "
                "atomically, so it must say exactly where",
                "write the folder as an absolute path",
            )
        )
        return None
    return posixpath.normpath(value)


def _decode_convert(decode: Role, convert: Convert, out: list[Problem]) -> None:
    weights = _weights_dir(decode, out)
    source = convert.source
    if not source:
        out.append(
            error(
                f"{CONVERT}.source",
                "no checkpoint to convert",
                "set source to the Hugging Face checkpoint folder (a path or a cluster "
                "model_paths alias)",
            )
        )
    elif not posixpath.isabs(source):
        out.append(
            warning(
                f"{CONVERT}.source",
                f"{source!r} is a hub id: the decode node takes its snapshot from the decode's "
                "Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub), as srtctl's "
                "snapshot_download(local_files_only=True) does; nothing is downloaded",
                "download it into that cache first, or use an absolute or ./ path, or a cluster "
                "model_paths alias",
            )
        )
    elif weights is not None:
        src = posixpath.normpath(source)
        if src == weights or src.startswith(weights.rstrip("/") + "/"):
            out.append(
                error(
                    f"{CONVERT}.source",
                    f"the checkpoint {source} is inside the weights folder {weights}, which the "
                    "agent replaces with the conversion",
                    "convert into another folder (roles.decode.args.model-weights-dir)",
                )
            )
    _model_type(decode, convert, out)
    with_mtp = find_arg(decode.args, "with-mtp")
    if convert.append_mtp and (with_mtp is None or with_mtp[1] is not True):
        out.append(
            error(
                f"{CONVERT}.append_mtp",
                "append_mtp adds the MTP layer, which only a decode with --with-mtp uses, and "
                "roles.decode.args.with-mtp is not set",
                "set roles.decode.args.with-mtp: true (with the prefill's MTP speculative-config), "
                "or remove append_mtp",
            )
        )
    if not convert.python.strip():
        out.append(
            error(
                f"{CONVERT}.python",
                "empty interpreter",
                "name the python that can import the converter, or remove it for `python`",
            )
        )
    else:
        program_path(f"{CONVERT}.python", convert.python, out)


def _model_type(decode: Role, convert: Convert, out: list[Problem]) -> None:
    found = find_arg(decode.args, "model")
    profile = found[1] if found else DEFAULT_TILERT_MODEL
    if profile not in TILERT_MODELS:
        return  # agent.recipe.rules reports the profile itself
    want = CONVERTER_MODEL_TYPES.get(str(profile))
    given = convert.model_type
    if want is None:
        out.append(
            error(
                CONVERT,
                f"the {profile} profile's weights are made by its own converter "
                "(tilert.models.glm_5_2_rocm.weight_converter), which the agent does not run",
                "convert them by hand (docs/weights.md) and remove convert",
            )
        )
        return
    if given is None:
        return
    if given not in CONVERTER_MODEL_TYPES.values():
        out.append(
            error(
                f"{CONVERT}.model_type",
                f"the converter has no model type {given!r}",
                f"use one of {', '.join(CONVERTER_MODEL_TYPES.values())}, or remove it",
            )
        )
    elif given != want:
        out.append(
            error(
                f"{CONVERT}.model_type",
                f"model type {given!r} does not match the decode model profile {profile!r}"
                f"{'' if found else ' (default)'}, which needs {want!r}",
                f"set model_type: {want} (or remove it), or change roles.decode.args.model",
            )
        )


def converter_model_type(decode: Role) -> str | None:
    """The converter's --model_type for a decode role: the recipe's, else its profile's."""
    if decode.convert is not None and decode.convert.model_type:
        return decode.convert.model_type
    found = find_arg(decode.args, "model")
    return CONVERTER_MODEL_TYPES.get(str(found[1] if found else DEFAULT_TILERT_MODEL))
