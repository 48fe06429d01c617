"""srtctl's ``sweep:`` section: one recipe, one job per combination of the values it lists.

```yaml
benchmark: {type: aiperf, concurrencies: ["{conc}"], ...}
roles: {decode: {args: {max-seq-len: "{seq}"}}}
sweep: {conc: [4, 16], seq: [4096, 8192]}      # 2 x 2 = 4 jobs
```

A value replaces a ``"{key}"`` placeholder anywhere in the recipe: a string that is exactly one
placeholder takes the value with its type (a number stays a number), a placeholder inside a longer
string is replaced by its text. Each job is named after its values (``name-conc4-seq4096``) unless
``name`` has placeholders of its own. The loader substitutes one combination before it checks
anything, so every combination is validated like a recipe of its own (``tilert-submit`` checks
them all before it submits any).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.problems import InputError, Problem, error

SWEEP_KEY = "sweep"
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_UNSAFE_IN_NAME = re.compile(r"[^A-Za-z0-9._-]+")
SweepValue = str | int | float | bool


@dataclass(frozen=True)
class Combination:
    """One combination of sweep values, in the order of the ``sweep:`` keys."""

    values: dict[str, SweepValue]

    def label(self) -> str:
        """``conc=4, seq=4096`` (for listings and messages)."""
        return ", ".join(f"{k}={_text(v)}" for k, v in self.values.items())

    def suffix(self) -> str:
        """``conc4-seq4096``: what a job name gets after the recipe's name."""
        parts = (f"{k}{_text(v)}" for k, v in self.values.items())
        return _UNSAFE_IN_NAME.sub("_", "-".join(parts))


def _text(value: SweepValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def read_sweep(raw: Mapping[str, Any]) -> list[Combination]:
    """Every combination of a recipe's ``sweep:`` section (InputError naming each bad key)."""
    section = raw.get(SWEEP_KEY)
    problems: list[Problem] = []
    if not isinstance(section, dict) or not section:
        raise InputError(
            [
                error(
                    SWEEP_KEY,
                    "expected a mapping of placeholder names to lists of values",
                    'write e.g. sweep: {conc: [4, 16]} and use "{conc}" where a value goes',
                )
            ]
        )
    axes: dict[str, list[SweepValue]] = {}
    for key, values in section.items():
        path = f"{SWEEP_KEY}.{key}"
        if not isinstance(key, str) or not _KEY.match(key):
            problems.append(
                error(path, f"'{key}' cannot be a placeholder name", "use letters, digits and _")
            )
        elif not isinstance(values, list) or not values:
            problems.append(error(path, "expected a non-empty list of values", f"{key}: [1, 2]"))
        elif not all(isinstance(v, str | int | float | bool) for v in values):
            problems.append(
                error(path, "each value must be a string, number or boolean", f"{key}: [1, 2]")
            )
        elif len({_text(v) for v in values}) != len(values):
            problems.append(error(path, "a value is listed twice", "list each value once"))
        else:
            axes[key] = values
    unused = [k for k in axes if not _uses(_without_sweep(raw), k)]
    problems += [
        error(
            f"{SWEEP_KEY}.{k}",
            f'no value in the recipe uses the placeholder "{{{k}}}"',
            f'put "{{{k}}}" where the value goes, e.g. concurrencies: ["{{{k}}}"]',
        )
        for k in unused
    ]
    if problems:
        raise InputError(problems)
    keys = list(axes)
    return [
        Combination(dict(zip(keys, values, strict=True)))
        for values in itertools.product(*(axes[k] for k in keys))
    ]


def _without_sweep(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k != SWEEP_KEY}


def _uses(node: Any, key: str) -> bool:
    if isinstance(node, str):
        return any(m.group(1) == key for m in PLACEHOLDER.finditer(node))
    if isinstance(node, dict):
        return any(_uses(v, key) for v in node.values())
    if isinstance(node, list):
        return any(_uses(v, key) for v in node)
    return False


def _substitute(node: Any, values: Mapping[str, SweepValue]) -> Any:
    if isinstance(node, str):
        whole = PLACEHOLDER.fullmatch(node)
        if whole and whole.group(1) in values:
            return values[whole.group(1)]
        return PLACEHOLDER.sub(
            lambda m: _text(values[m.group(1)]) if m.group(1) in values else m.group(0), node
        )
    if isinstance(node, dict):
        return {k: _substitute(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, values) for v in node]
    return node


def apply_combination(raw: Mapping[str, Any], combination: Combination) -> dict[str, Any]:
    """The recipe of one combination: values substituted, ``sweep:`` gone, the name extended."""
    plain = _without_sweep(raw)
    result: dict[str, Any] = _substitute(plain, combination.values)
    name = plain.get("name")
    if isinstance(name, str) and not PLACEHOLDER.search(name):
        result["name"] = f"{name}-{combination.suffix()}"
    return result
