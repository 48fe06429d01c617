"""How the rules read recipe values: JSON-valued engine args, env settings, model locations, hosts.

A reader that meets a value it cannot read appends the problem to ``out`` and says so in its
result, so that the rule using it reports that problem once and skips what depends on the value.
Imports facts, problems and the recipe model only.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from typing import Any

from agent.facts import CONNECTOR, CONNECTOR_MODULE, CONNECTOR_ROLE
from agent.problems import Problem, error
from agent.recipe.model import EnvValue, Role, env_value, find_arg


def json_arg(
    role: Role, role_name: str, name: str, out: list[Problem]
) -> tuple[str, dict[str, Any] | None] | None:
    """(path, parsed object) of a JSON-valued arg (a string or a mapping); None when absent."""
    found = find_arg(role.args, name)
    if found is None:
        return None
    key, value = found
    path = f"roles.{role_name}.args.{key}"
    if isinstance(value, dict):
        return path, value
    if not isinstance(value, str):
        out.append(error(path, "expected a JSON object (a string or a mapping)", json_hint(name)))
        return path, None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        out.append(
            error(path, f"is not valid JSON: {exc.msg} at character {exc.pos}", json_hint(name))
        )
        return path, None
    if not isinstance(parsed, dict):
        out.append(error(path, "must be a JSON object", json_hint(name)))
        return path, None
    return path, parsed


def json_hint(name: str) -> str:
    """How to write the JSON-valued arg ``name`` (the connector's fields for kv-transfer-config)."""
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


def env_setting(env: Mapping[str, EnvValue], name: str) -> str | None:
    """The value of ``name`` in an environment as the engine sees it; None when it is unset."""
    value = env.get(name)
    return None if value is None else env_value(value)


def env_path(name: str, roles: list[tuple[str, Role]]) -> str:
    """Where ``name`` is set: the first of ``roles`` whose ``env`` has it, else ``environment``."""
    for role_name, role in roles:
        if name in role.env:
            return f"roles.{role_name}.env.{name}"
    return f"environment.{name}"


def is_hub_id(value: str) -> bool:
    """Whether a model location is a hub id rather than a local path."""
    return not value.startswith(("/", "./", "../", "~"))


def is_bare_ipv4(value: Any) -> bool:
    """Whether ``value`` is a dotted IPv4 address alone (no brackets, no port)."""
    if not isinstance(value, str):
        return False
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        return False
    return True


def program_path(path: str, value: str, out: list[Problem]) -> None:
    """A program the agent starts on the node (an interpreter, ``aiperf``): a bare name (looked up
    on the engine's PATH) or an absolute path. A relative path would be resolved against the
    node's working directory (in a container, the container's), which the recipe cannot know."""
    if "/" in value and not value.startswith("/"):
        out.append(
            error(
                path,
                f"{value!r} is a relative path: it would be resolved against the node's working "
                "directory (in a container, the container's)",
                f"write an absolute path (e.g. $PWD/{value.removeprefix('./')} on the command "
                "line), or a bare name found on the engine's PATH",
            )
        )
