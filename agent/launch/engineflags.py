"""Engine flags checked by the engine itself: each program is asked for its own flags on the node.

A recipe flag that the image's engine version no longer has (or never had) is otherwise found
after the model loaded. Before the load, the preflight runs the engine's own help (``vllm serve
--help=all``, else ``--help``; TileRT's decode server and router ``--help``) through the same
launcher, in the same image and environment, reads the flags it lists, and refuses one it does not
know with the recipe key, the image, the engine version and the closest known flag. The answer is
cached per image (or interpreter), program and engine version in a folder (docs/preflight.md), so
the 10-60 s a vLLM import takes is paid once per version.

A stand-in accepts and ignores flags it does not emulate (it takes the real engines' argument
lists): for a stand-in an unknown flag is a note, never a refusal.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import posixpath
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec

from agent.job.atomicfile import write_atomic
from agent.job.preflightpolicy import PreflightPolicy
from agent.launch.spec import Launcher, LaunchSpec, RunTimeout

FLAG_CACHE_ENV = "TILERT_FLAG_CACHE"
CACHE_SCHEMA = 1
# A help that lists fewer flags than this did not answer (a wrapper that ignored --help, say).
MIN_FLAGS = 2
# An option at the start of a help line (``  --max-model-len MAX_MODEL_LEN``), after ``[`` or
# ``|`` in the usage, or after ``, `` among its aliases. Flags named inside descriptions are not
# taken: a flag the help only mentions is not one the program accepts.
_OPTION = re.compile(r"(?:^[ \t]*|\[|\|[ \t]*|,[ \t]*)(--[A-Za-z0-9][A-Za-z0-9_.-]*)", re.M)


@dataclass(frozen=True)
class Flag:
    """One flag of the command line and where it comes from (a recipe key, or the agent)."""

    flag: str
    origin: str


@dataclass(frozen=True)
class FlagQuestion:
    """What to ask one engine program, and which of its command line's flags to check."""

    # "vLLM", "the TileRT decode server", "the TileRT router", with "stand-in" for ours.
    engine: str
    # The help commands to try in order (the first that lists flags wins).
    help_argvs: list[list[str]]
    # The distribution whose version names the engine version (vllm, tilert).
    distribution: str
    flags: list[Flag]
    standin: bool = False
    # vLLM reads --max_model_len as --max-model-len, and --a.b as --a with a JSON field.
    lenient: bool = False
    # Why the flags cannot be checked (a site's launcher script that is not vLLM's): a note.
    not_asked: str | None = None
    # What else tells one answer from another (a stand-in's source file: its size and mtime).
    fingerprint: str = ""


@dataclass
class FlagVerdict:
    """Refusals (the job must not load) and notes (logged), from one engine's check."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # What was compared with what, for the log ("" when nothing was).
    summary: str = ""


class _CacheEntry(msgspec.Struct):
    """One cached answer: what was asked, of which image and version, and the flags listed."""

    schema: int
    key: dict[str, str]
    flags: list[str]
    # The help command that answered (shown in a refusal: how to see the list by hand).
    answered: str
    created: float


def parse_help(text: str) -> set[str]:
    """The long flags a ``--help`` text lists (its usage and option lines)."""
    return {m.group(1) for m in _OPTION.finditer(text)}


def cache_dir(configured: str | None, env: Mapping[str, str]) -> Path:
    """agent.preflight.flag_cache_dir, else $TILERT_FLAG_CACHE, else the user's cache folder."""
    if configured:
        return Path(configured).expanduser()
    if env.get(FLAG_CACHE_ENV):
        return Path(env[FLAG_CACHE_ENV]).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tilert-agent" / "engine-flags"


def _cache_file(folder: Path, key: Mapping[str, str]) -> Path:
    digest = hashlib.sha256(msgspec.json.encode(dict(sorted(key.items())))).hexdigest()[:16]
    version = re.sub(r"[^A-Za-z0-9.+-]", "_", key.get("version", ""))[:40] or "unknown"
    return folder / f"{key.get('distribution', 'engine')}-{version}-{digest}.json"


def _cached(folder: Path, key: Mapping[str, str]) -> _CacheEntry | None:
    try:
        entry = msgspec.json.decode(_cache_file(folder, key).read_bytes(), type=_CacheEntry)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None  # absent, unreadable or of another schema: ask again
    if entry.schema != CACHE_SCHEMA or entry.key != dict(key) or len(entry.flags) < MIN_FLAGS:
        return None
    return entry


def _store(folder: Path, entry: _CacheEntry) -> str | None:
    """Cache the flags; a note when the folder refuses (the check itself does not depend on it)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(_cache_file(folder, entry.key), msgspec.json.encode(entry) + b"\n")
    except OSError as exc:
        return (
            f"the engine flags could not be cached in {folder} ({exc.strerror or exc}); they "
            "are asked again next time: set agent.preflight.flag_cache_dir to a writable folder"
        )
    return None


def canonical(flag: str, lenient: bool) -> str:
    """The flag as the engine's parser reads it (vLLM: ``_`` is ``-``, ``--a.b`` is ``--a``)."""
    if not lenient:
        return flag
    name = flag[2:].split(".", 1)[0]
    return "--" + name.replace("_", "-")


def closest(flag: str, known: Sequence[str]) -> str | None:
    """The known flag nearest to ``flag`` (difflib), or None when nothing is close."""
    found = difflib.get_close_matches(flag, sorted(known), n=1, cutoff=0.6)
    return found[0] if found else None


def judge(
    question: FlagQuestion, known: _CacheEntry, *, version: str, image: str | None
) -> FlagVerdict:
    """Compare the command line's flags with the flags the program listed."""
    verdict = FlagVerdict()
    where = f"image {image}" if image else "the node's installation (no image)"
    listed = {canonical(f, question.lenient) for f in known.flags}
    for item in question.flags:
        if canonical(item.flag, question.lenient) in listed:
            continue
        near = closest(canonical(item.flag, question.lenient), sorted(listed))
        hint = f"did you mean {near}?" if near else "no known flag is close"
        if question.standin:
            verdict.notes.append(
                f"{item.origin}: the {question.engine} does not emulate {item.flag} and ignores "
                "it; the real engine checks it on its own node"
            )
            continue
        verdict.problems.append(
            f"{item.origin}: {question.engine} ({version}) in {where} does not know "
            f"{item.flag} ({hint}); fix or remove that key, or use an image whose engine has "
            f"the flag (`{known.answered}` lists its flags)"
        )
    return verdict


async def _ask(
    launcher: Launcher, spec: LaunchSpec, question: FlagQuestion, timeout_s: float
) -> tuple[set[str] | None, str]:
    """Run the help commands in order: (flags, the command that answered) or (None, why not)."""
    why = "no help command"
    for argv in question.help_argvs:
        shown = " ".join(argv)
        try:
            code, output = await launcher.run(replace(spec, argv=argv), timeout_s=timeout_s)
        except RunTimeout:
            why = f"`{shown}` did not finish within {timeout_s:g}s"
            continue
        except OSError as exc:
            why = f"`{shown}` could not start: {exc.strerror or exc}"
            continue
        flags = parse_help(output.decode(errors="replace"))
        if code == 0 and len(flags) >= MIN_FLAGS:
            return flags, shown
        why = f"`{shown}` exited {code} listing {len(flags)} flags"
    return None, why


async def check_flags(
    launcher: Launcher,
    spec_base: LaunchSpec,
    question: FlagQuestion,
    *,
    versions: Mapping[str, str],
    folder: Path,
    timeout_s: float,
) -> FlagVerdict:
    """Ask (or read from the cache) the program's flags and judge the command line's.

    ``spec_base`` carries the engine's image, mounts, environment and setup script."""
    if question.not_asked is not None:
        return FlagVerdict(notes=[question.not_asked])
    if not question.help_argvs or not question.flags:
        return FlagVerdict()
    version = versions.get(question.distribution, "version unknown")
    named = f"{question.distribution} {version}"
    key = {
        "distribution": question.distribution,
        "version": version,
        "image": spec_base.image or "",
        "help": " ".join(question.help_argvs[0]),
        "fingerprint": question.fingerprint,
    }
    entry = _cached(folder, key)
    notes: list[str] = []
    source = f"cached in {_cache_file(folder, key)}"
    if entry is None:
        source = "asked now"
        known, answered = await _ask(launcher, spec_base, question, timeout_s)
        if known is None:
            return FlagVerdict(
                notes=[
                    f"the flags of {question.engine} ({named}) could not be listed ({answered}); "
                    "the recipe's flags are not checked before the load: check the image, or set "
                    "agent.preflight.engine_flags: off to skip this"
                ]
            )
        entry = _CacheEntry(CACHE_SCHEMA, key, sorted(known), answered, time.time())
        stored = _store(folder, entry)
        notes += [stored] if stored else []
    verdict = judge(question, entry, version=named, image=spec_base.image)
    verdict.notes[:0] = notes
    verdict.summary = (
        f"{len(question.flags)} flags of the command line against the {len(entry.flags)} that "
        f"`{entry.answered}` lists ({named}, {source})"
    )
    return verdict


def help_argvs(program: Sequence[str], *, vllm: bool) -> list[list[str]]:
    """The help commands of a program: vLLM's ``--help=all`` first (its ``--help`` is a summary)."""
    base = list(program)
    return [[*base, "--help=all"], [*base, "--help"]] if vllm else [[*base, "--help"]]


def vllm_program(prefill_command: Sequence[str]) -> list[str] | None:
    """The part of ``agent.prefill_command`` that is vLLM's server (its trailing flags dropped).

    None for a site's launcher script: its own ``--help`` may not be vLLM's, or may start it.
    """
    words = list(prefill_command)
    while words and words[-1].startswith("-"):
        words.pop()
    if len(words) >= 2 and posixpath.basename(words[-2]) == "vllm" and words[-1] == "serve":
        return words
    if len(words) >= 3 and words[-2] == "-m" and words[-1].startswith("vllm."):
        return words
    return None


async def flag_refusals(
    launcher: Launcher,
    spec_base: LaunchSpec,
    question: FlagQuestion,
    *,
    versions: Mapping[str, str],
    policy: PreflightPolicy,
    log: logging.Logger,
    who: str,
) -> list[str]:
    """The flag check under ``agent.preflight``: what refuses the load (notes and, with ``warn``,
    the unknown flags are logged)."""
    if policy.engine_flags == "off":
        return []
    verdict = await check_flags(
        launcher,
        spec_base,
        question,
        versions=versions,
        folder=cache_dir(policy.flag_cache_dir, os.environ),
        timeout_s=policy.flag_timeout_s,
    )
    for note in verdict.notes:
        log.warning("%s: engine flags: %s", who, note)
    if verdict.summary:
        log.info("%s: engine flags: %s", who, verdict.summary)
    if policy.engine_flags == "check":
        return verdict.problems
    for problem in verdict.problems:
        log.warning("%s: engine flags (agent.preflight.engine_flags: warn): %s", who, problem)
    return []
