"""``--set KEY=VALUE`` and ``--unset KEY``: change or remove one recipe value from the command line
before validation.

KEY is a dotted recipe path (``roles.prefill.env.HF_HUB_OFFLINE``); VALUE is YAML-typed with the
recipe's own YAML rules (``2`` is an integer, ``true`` a boolean, ``"2"`` a string, an empty value
null, ``{a: 1}`` a mapping). Missing mappings along the path are created, so new ``env`` and
``args`` keys can be added. ``--unset`` removes a key that is there (a key that is not is an
error: a typo must not pass silently). The result is validated like the file itself.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from agent.problems import InputError, Problem, error
from agent.recipe.typedyaml import YamlSyntaxError, load_scalar

FLAG = "--set"
UNSET_FLAG = "--unset"


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split one ``KEY=VALUE`` into path parts and the YAML-typed value (InputError when bad)."""
    where = f"{FLAG} {item}"
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep:
        raise InputError(
            [error(where, "expected KEY=VALUE", "write e.g. --set roles.decode.nodes=2")]
        )
    parts = key.split(".")
    if not key or any(not part.strip() for part in parts):
        raise InputError(
            [
                error(
                    where,
                    f"'{key}' is not a dotted recipe path",
                    "use non-empty keys separated by single dots, e.g. roles.prefill.env.X=1",
                )
            ]
        )
    try:
        value = load_scalar(text)
    except YamlSyntaxError as exc:
        raise InputError(
            [error(where, f"the value is not valid YAML: {exc.detail}", "quote the value")]
        ) from None
    return [part.strip() for part in parts], value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``raw`` with every ``--set`` applied in order (all bad flags reported together)."""
    result = copy.deepcopy(raw)
    problems: list[Problem] = []
    for item in overrides:
        try:
            parts, value = parse_override(item)
        except InputError as exc:
            problems.extend(exc.problems)
            continue
        node: Any = result
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                walked = ".".join(parts[: depth + 1])
                problems.append(
                    error(
                        f"{FLAG} {item}",
                        f"'{walked}' is a {type(child).__name__} value, not a mapping",
                        f"set {walked} itself, e.g. --set {walked}=VALUE",
                    )
                )
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise InputError(problems)
    return result


def apply_unsets(raw: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """A copy of ``raw`` without every ``--unset`` key (all bad flags reported together)."""
    result = copy.deepcopy(raw)
    problems: list[Problem] = []
    for key in keys:
        where = f"{UNSET_FLAG} {key}"
        parts = [part.strip() for part in key.split(".")]
        if not key.strip() or any(not part for part in parts):
            problems.append(
                error(
                    where, f"'{key}' is not a dotted recipe path", "e.g. --unset roles.decode.env.X"
                )
            )
            continue
        node: Any = result
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or parts[-1] not in node:
            problems.append(
                error(where, f"the recipe has no '{key}' to remove", "check the dotted path")
            )
            continue
        del node[parts[-1]]
    if problems:
        raise InputError(problems)
    return result
