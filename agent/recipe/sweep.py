"""srtctl's ``sweep:`` section: one recipe, one job per combination of the values it lists.

```yaml
benchmark: {type: aiperf, concurrencies: ["{conc}"], ...}
roles: {decode: {args: {max-seq-len: "{seq}"}}}
sweep: {conc: [4, 16], seq: [4096, 8192]}      # 2 x 2 = 4 jobs
```

A value replaces a ``"{key}"`` placeholder anywhere in the recipe: a string that is exactly one
placeholder takes the value with its type (a number stays a number), a placeholder inside a longer
string is replaced by its text. Each job is named after its values (``name-conc4-seq4096``) unless
``name`` has placeholders of its own. The loader applies ``--set``/``--unset`` first, then
substitutes one combination before it checks anything, so every combination is validated like a
recipe of its own (``tilert-submit`` checks them all before it submits any).

Bounds, checked before anything is expanded: the number of combinations is the product of the
lists' lengths and may not pass ``--max-jobs`` (``MAX_JOBS`` by default); every placeholder in the
recipe must be a sweep key (``${NAME}`` is the shell's and is left alone).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.problems import InputError, Problem, error

SWEEP_KEY = "sweep"
# ``{name}``, not the shell's ``${name}`` (a custom command's variables).
PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Combinations submitted without --max-jobs: each is a job directory and an sbatch call.
MAX_JOBS = 256
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


def read_sweep(raw: Mapping[str, Any], max_jobs: int = MAX_JOBS) -> list[Combination]:
    """Every combination of a recipe's ``sweep:`` section (InputError naming each bad key, an
    unknown placeholder, or more than ``max_jobs`` combinations: counted before expanding)."""
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
    problems += _placeholder_problems(raw, section, axes)
    if problems:
        raise InputError(problems)
    keys = list(axes)
    _check_bound(axes, max_jobs)
    return [
        Combination(dict(zip(keys, values, strict=True)))
        for values in itertools.product(*(axes[k] for k in keys))
    ]


def _placeholder_problems(
    raw: Mapping[str, Any], section: Mapping[Any, Any], axes: Mapping[str, list[SweepValue]]
) -> list[Problem]:
    """A sweep key no placeholder uses, and a placeholder that is no sweep key."""
    used = _placeholders(_without_sweep(raw))
    problems = [
        error(
            f"{SWEEP_KEY}.{k}",
            f'no value in the recipe uses the placeholder "{{{k}}}"',
            f'put "{{{k}}}" where the value goes, e.g. concurrencies: ["{{{k}}}"]',
        )
        for k in axes
        if k not in used
    ]
    keys_said = ", ".join(str(k) for k in section) or "none"
    problems += [
        error(
            path,
            f'"{{{name}}}" is not a sweep key (the sweep has: {keys_said})',
            f"add {name}: [...] to sweep:, or write the value itself",
        )
        for name, path in sorted(used.items())
        if name not in section
    ]
    return problems


def _check_bound(axes: Mapping[str, list[SweepValue]], max_jobs: int) -> None:
    """InputError when the combinations (counted, not built) are more than ``max_jobs``."""
    count = math.prod(len(values) for values in axes.values())
    if count > max_jobs:
        sizes = " x ".join(str(len(values)) for values in axes.values())
        raise InputError(
            [
                error(
                    SWEEP_KEY,
                    f"{count:,} combinations ({sizes}), more than the limit of {max_jobs:,} jobs",
                    f"list fewer values, or pass --max-jobs {count} to submit them all",
                )
            ]
        )


def _without_sweep(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k != SWEEP_KEY}


def _placeholders(node: Any, path: str = "") -> dict[str, str]:
    """Each placeholder used in a value of ``node``, with the dotted key path of its first use."""
    found: dict[str, str] = {}
    if isinstance(node, str):
        return {m.group(1): path for m in PLACEHOLDER.finditer(node)}
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for k, v in items:
        where = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k)
        for name, at in _placeholders(v, where).items():
            found.setdefault(name, at)
    return found


def unfilled(raw: Mapping[str, Any]) -> dict[str, str]:
    """Placeholders left in a recipe without a sweep (``--unset sweep`` without a ``--set`` for
    each), with where each is used."""
    return _placeholders(_without_sweep(raw))


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
