"""Which sources ``tilert-submit logs`` shows, and where each one is read.

A source is one log with a name: ``prefill-0``, ``decode-N`` (their engine logs, or with
``--agent`` their ``agent.log``), ``router`` and ``benchmark`` (whose logs sit in the head's or the
benchmark's folder). NAMEs on the command line are exact names or shell patterns (``decode-*``),
matched again at every rescan, so a source that appears later joins. Engine logs kept on the nodes
(``agent.logs.location: node``) are read through their agent's ``/logs``: a source then says which
agent serves it.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

import msgspec

from agent.errors import BadInput
from agent.job.logfiles import log_files, log_path, node_local
from agent.job.names import BENCHMARK_NAME, HEAD_NAME, ROUTER_NAME, agent_names
from agent.job.paths import JobDir
from agent.job.plan import Plan, load_plan

_PATTERN_CHARS = "*?["
# Names that are not agents: they have no agent.log, and their logs sit in the head's node.
_NOT_AGENTS = (ROUTER_NAME, BENCHMARK_NAME)


class SelectionError(BadInput):
    """A NAME that names nothing; the message says what the job has."""


@dataclass(frozen=True)
class Source:
    """One log to show: its name, its current file and, when only an agent can read that file
    (node-local logs), the agent and the name its ``/logs`` knows the file by."""

    name: str
    path: Path
    agent: str | None = None
    key: str = "engine"

    @property
    def remote(self) -> bool:
        """Whether the file is read through an agent's ``/logs``."""
        return self.agent is not None


def read_plan(job: JobDir) -> Plan | None:
    """The job's plan, or None when plan.json is missing or unreadable (names come from disk)."""
    try:
        return load_plan(job.plan.read_bytes())
    except (OSError, ValueError, msgspec.DecodeError):
        return None


class Catalogue:
    """The sources of one job for one view (engine logs, or the agents' own with ``agent``)."""

    def __init__(self, job: JobDir, plan: Plan | None, *, agent: bool) -> None:
        self.job = job
        self.plan = plan
        self.agent = agent
        # agent.log always stays in the job directory; only engine logs may be node-local.
        self.node_local = node_local(plan) and not agent

    def planned(self) -> list[str]:
        """The names the plan says this job has (with the router for engine logs)."""
        if self.plan is None:
            return []
        names = list(agent_names(self.plan.prefill.nodes, self.plan.decode.nodes))
        return names if self.agent else [*names, ROUTER_NAME]

    def present(self) -> list[str]:
        """Names whose folders exist in ``J/logs`` now, in display order."""
        return list(log_files(self.job, agent=self.agent))

    def known(self) -> list[str]:
        """Planned names, then any other source found on disk, in display order."""
        names = self.planned()
        return names + [n for n in self.present() if n not in names]

    def source(self, name: str) -> Source:
        """Where ``name``'s log is read."""
        path = log_path(self.job, name, agent=self.agent, plan=self.plan)
        if not self.node_local:
            return Source(name, path)
        if name in _NOT_AGENTS:
            return Source(name, path, agent=HEAD_NAME, key=name)
        return Source(name, path, agent=name, key="engine")


class Selection:
    """The NAMEs asked for: none (every source present), exact names and shell patterns."""

    def __init__(self, words: list[str], catalogue: Catalogue) -> None:
        self.words = words
        self.catalogue = catalogue
        self.check()

    @property
    def everything(self) -> bool:
        """No NAME was given: every source, as they appear."""
        return not self.words

    def check(self) -> None:
        """Refuse an unknown name or a pattern that matches nothing (``SelectionError``)."""
        known = self.catalogue.known()
        agent = self.catalogue.agent
        which = ", ".join(known) or "none yet"
        for word in self.words:
            if agent and word in _NOT_AGENTS:
                raise SelectionError(
                    f"the {word} has no agent.log of its own: see {HEAD_NAME}; "
                    f"this job's agents are: {which}"
                )
            if _is_pattern(word):
                if not fnmatch.filter(known, word):
                    raise SelectionError(f"no source matches {word!r}; this job has: {which}")
            elif word not in known and word != BENCHMARK_NAME:
                raise SelectionError(f"unknown NAME {word!r}; this job has: {which}")

    def names(self) -> list[str]:
        """The selected names now, in display order (patterns matched against what exists)."""
        if self.everything:
            return self.catalogue.present()
        known = self.catalogue.known()
        chosen = {word for word in self.words if not _is_pattern(word)}
        for word in self.words:
            if _is_pattern(word):
                # A pattern takes what exists or is planned, never a name that may never come.
                chosen.update(fnmatch.filter(known, word))
        order = known if BENCHMARK_NAME in known else [*known, BENCHMARK_NAME]
        return [n for n in order if n in chosen]

    def sources(self) -> list[Source]:
        """The selected sources now."""
        return [self.catalogue.source(n) for n in self.names()]


def missing_log(source: Source, follow: bool) -> str:
    """What to say about a source whose log does not exist (yet)."""
    if source.name == BENCHMARK_NAME:
        why = "this job has run no benchmark yet"
    else:
        why = "nothing written yet"
    wait = "; waiting for it" if follow else ""
    return f"{source.name}: no log yet ({source.path} does not exist: {why}){wait}"


def _is_pattern(word: str) -> bool:
    return any(c in word for c in _PATTERN_CHARS)
