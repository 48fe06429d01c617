"""Which environment values are secret, and how they are shown: one rule for every output."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TypeVar

_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
MASK = "***"

_Value = TypeVar("_Value")


def is_secret_name(name: str) -> bool:
    """Whether an environment variable name looks secret (``*TOKEN*``, ``*KEY*``, ...)."""
    return bool(_SECRET_NAME.search(name))


def masked(env: Mapping[str, _Value]) -> dict[str, _Value | str]:
    """A copy of ``env`` with secret values replaced by ``***``."""
    return {k: (MASK if is_secret_name(k) else v) for k, v in env.items()}
