"""``--set KEY=VALUE`` and ``--unset KEY``: change or remove one recipe value from the command line
before validation.

KEY is a dotted recipe path (``roles.prefill.env.HF_HUB_OFFLINE``); VALUE is YAML-typed with the
recipe's own YAML rules (``2`` is an integer, ``true`` a boolean, ``"2"`` a string, an empty value
null, ``{a: 1}`` a mapping). Missing mappings along the path are created, so new ``env`` and
``args`` keys can be added. ``--unset`` removes a key that is there (a key that is not is an
error: a typo must not pass silently). The result is validated like the file itself.

A VALUE ``@env:NAME`` or ``@file:PATH`` is read, as a string, from the submitter's environment
variable NAME or from the file PATH (one trailing newline dropped): a secret given so never
appears on a command line, where every user of the machine can read it (``ps``).
"""

from __future__ import annotations

import copy
import os
import select
import stat
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.problems import InputError, Problem, error
from agent.recipe.typedyaml import MAX_DEPTH, YamlSyntaxError, load_scalar

FLAG = "--set"
UNSET_FLAG = "--unset"
FROM_ENV = "@env:"
FROM_FILE = "@file:"
# A secret is a token or a password, not a document: a bigger file is a mistake.
FROM_FILE_LIMIT = 64 * 1024
# A pipe's writer (``<(pass show token)``, which may ask for a passphrase) gets this long; after
# FROM_FILE_SAY_AFTER_S the wait is said.
FROM_FILE_WAIT_S = 60.0
FROM_FILE_SAY_AFTER_S = 1.0
PROG_NAME = "tilert-submit"


def _read_secret_file(where: str, name: str) -> str:
    path = Path(name).expanduser()
    try:
        data = _read_bounded(path, where)
    except OSError as exc:
        raise InputError(
            [error(where, f"cannot read {path}: {exc.strerror or exc}", "name a readable file")]
        ) from None
    if len(data) > FROM_FILE_LIMIT:
        raise InputError(
            [
                error(
                    where,
                    f"{path} is larger than {FROM_FILE_LIMIT // 1024} KiB",
                    "name the file that holds only the value",
                )
            ]
        )
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise InputError(
            [error(where, f"{path} is not UTF-8 text", "store the value as text")]
        ) from None
    return text.removesuffix("\n").removesuffix("\r")


def _read_bounded(path: Path, where: str) -> bytes:
    """At most FROM_FILE_LIMIT + 1 bytes of ``path``; a pipe (``<(pass show x)``, a FIFO) is
    read until its writer closes it, within FROM_FILE_WAIT_S (InputError after it), saying so
    when its writer is slow."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO with no writer opens at once
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.set_blocking(fd, True)
            return os.read(fd, FROM_FILE_LIMIT + 1)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + FROM_FILE_WAIT_S
        said = False
        data = b""
        while len(data) <= FROM_FILE_LIMIT:
            left = deadline - time.monotonic()
            if left <= 0:
                raise InputError(
                    [
                        error(
                            where,
                            f"{path} gave no end of its value within {FROM_FILE_WAIT_S:g}s (a "
                            "pipe whose writer never wrote, or never closed it)",
                            "start the writer first, or put the value in a regular file",
                        )
                    ]
                )
            if not poller.poll(min(left, FROM_FILE_SAY_AFTER_S) * 1000):
                if not said:
                    said = True
                    print(
                        f"{PROG_NAME}: waiting for {path} (a pipe) to be written, up to "
                        f"{FROM_FILE_WAIT_S:g}s; Ctrl-C to stop",
                        file=sys.stderr,
                        flush=True,
                    )
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                break  # the writer closed it
            data += chunk
        return data
    finally:
        os.close(fd)


def read_indirect(where: str, text: str) -> str | None:
    """The string an ``@env:NAME`` / ``@file:PATH`` value names; None for a plain YAML value."""
    if text.startswith(FROM_ENV):
        name = text[len(FROM_ENV) :]
        if name not in os.environ:
            raise InputError(
                [error(where, f"the environment has no variable {name!r}", f"export {name} first")]
            )
        return os.environ[name]
    if text.startswith(FROM_FILE):
        return _read_secret_file(where, text[len(FROM_FILE) :])
    return None


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
    if len(parts) > MAX_DEPTH:
        raise InputError(
            [
                error(
                    where,
                    f"'{key}' has {len(parts)} parts, more than a recipe nests ({MAX_DEPTH})",
                    "name an existing recipe key, e.g. roles.prefill.env.X=1",
                )
            ]
        )
    indirect = read_indirect(where, text)
    if indirect is not None:
        return [part.strip() for part in parts], indirect
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
