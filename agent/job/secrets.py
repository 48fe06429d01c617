"""Which environment values are secret, and how they are shown: one rule for every output."""

from __future__ import annotations

import re

_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
MASK = "***"


def is_secret_name(name: str) -> bool:
    """Whether an environment variable name looks secret (``*TOKEN*``, ``*KEY*``, ...)."""
    return bool(_SECRET_NAME.search(name))


def masked(env: dict[str, str]) -> dict[str, str]:
    """A copy of ``env`` with secret values replaced by ``***``."""
    return {k: (MASK if is_secret_name(k) else v) for k, v in env.items()}
