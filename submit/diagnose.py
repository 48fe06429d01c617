"""``tilert-submit diagnose J [--json]``: per agent, what failed, the log lines that show it (file
and line number), the cause and the fix.

Reads the job directory only (status.json, plan.json and the engine logs, rotated backups
included), so it works for a job that has ended as well as a running one. The log lines are
matched against the failure signatures the agents know (``agent.signatures``, docs/diagnose.md).
Exit 0 when nothing is wrong (no agent failed or unhealthy, no signature in any log), 1 when
something is, 2 when J is not a job directory.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import msgspec

from agent.errors import EXIT_OK, EXIT_RUNTIME
from agent.job.logfiles import log_path, node_local, rotated_files
from agent.job.paths import JobDir
from agent.job.records import JobAgent, JobStatus
from agent.problems import printable
from agent.signatures import NOTES, Finding, SignatureSet, for_role, match_block
from submit.statusview import open_job, read_plan, read_status

# Lines shown per signature and agent (the first and the last ones; the count says how many).
SHOWN_LINES = 4
_READ_BYTES = 4 * 1024 * 1024
BAD_STATES = ("failed", "unhealthy", "restarting", "degraded")
# The agent's marker lines in an engine log (docs/logs.md): ``=== decode-1 failed: WHY ===``.
MARKER = "=== "


class LogLine(msgspec.Struct, kw_only=True):
    """One log line a signature matched."""

    file: str
    line: int
    text: str


class Diagnosis(msgspec.Struct, kw_only=True):
    """One signature seen in one agent's log."""

    signature: str
    cause: str
    fix: str
    fatal: bool
    count: int
    lines: list[LogLine]


class AgentReport(msgspec.Struct, kw_only=True):
    """One agent (or the router): its state, its reason, and the signatures its log shows."""

    name: str
    role: str
    state: str
    reason: str
    logs: list[str]
    findings: list[Diagnosis]
    # Why its log could not be read here (node-local logs, a missing file), if so.
    unread: str | None = None


class Report(msgspec.Struct, kw_only=True):
    """``diagnose --json``."""

    job: str
    state: str
    error: str | None
    ok: bool
    agents: list[AgentReport]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``diagnose J [--json]``."""
    parser.add_argument("job_dir", metavar="J", help="the job directory tilert-submit printed")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def scan_file(
    path: Path, signatures: SignatureSet, *, notes: bool = False
) -> Iterator[tuple[int, Finding]]:
    """``(line number, finding)`` for every signature line of ``path``, read in blocks
    (``notes``: the agent's own marker lines only, agent.signatures ``NOTES``)."""
    lines_before = 0
    rest = b""
    with path.open("rb") as f:
        while True:
            data = f.read(_READ_BYTES)
            block = rest + data
            if data:
                cut = block.rfind(b"\n") + 1
                block, rest = block[:cut], block[cut:]
            else:
                rest = b""
            for offset, finding in match_block(block, signatures, whole=True):
                if finding.line.startswith(MARKER) != notes:
                    continue  # the agent's own note, which quotes the engine's line
                yield lines_before + block.count(b"\n", 0, offset) + 1, finding
            lines_before += block.count(b"\n")
            if not data:
                return


def _findings(files: list[Path], role: str) -> list[Diagnosis]:
    found: dict[str, Diagnosis] = {}
    signatures = for_role(role)
    notes = SignatureSet(tuple(n for n in NOTES if role in n.where))
    scans = [(p, s, s is notes) for p in files for s in (signatures, notes) if s.items]
    for path, which, own in scans:
        for number, finding in scan_file(path, which, notes=own):
            sig = finding.signature
            entry = found.get(sig.name)
            if entry is None:
                entry = found[sig.name] = Diagnosis(
                    signature=sig.name,
                    cause=finding.cause,
                    fix=sig.fix,
                    fatal=sig.fatal,
                    count=0,
                    lines=[],
                )
            entry.count += 1
            line = LogLine(file=str(path), line=number, text=finding.line.strip())
            if len(entry.lines) < SHOWN_LINES:
                entry.lines.append(line)
            else:  # keep the first ones and the latest
                entry.lines[-1] = line
    # Specific causes first; a generic one ("the engine core died") only says "look above".
    by_name = {s.name: s for s in (*signatures.items, *notes.items)}
    return sorted(found.values(), key=lambda d: (by_name[d.signature].generic, not d.fatal))


def _report(agent: JobAgent, plan_logs_node_local: bool, path: Path) -> AgentReport:
    files = [*rotated_files(path), path] if path.exists() else []
    unread = None
    if not files:
        unread = (
            f"{path} is on node {agent.node} (agent.logs.location: node): run diagnose there "
            "or read it with tilert-submit logs"
            if plan_logs_node_local
            else f"no log at {path} (the agent never started its engine)"
        )
    return AgentReport(
        name=agent.name,
        role=agent.role,
        state=agent.state,
        reason=agent.reason,
        logs=[str(p) for p in files],
        findings=_findings(files, agent.role) if files else [],
        unread=unread,
    )


def diagnose(job: JobDir) -> Report:
    """The report for ``job`` (read from its directory)."""
    status: JobStatus = read_status(job)
    plan = read_plan(job)
    on_nodes = node_local(plan)
    agents = [*status.agents, *([status.router] if status.router is not None else [])]
    reports = [_report(a, on_nodes, log_path(job, a.name, plan=plan)) for a in agents]
    ok = (
        status.state not in BAD_STATES
        and all(r.state not in BAD_STATES and not r.findings for r in reports)
        and not status.error
    )
    return Report(job=str(job.root), state=status.state, error=status.error, ok=ok, agents=reports)


def render(report: Report) -> str:
    """The human view: per agent its state, then each signature with its lines, cause and fix."""
    out = [f"job {report.job}: {report.state}"]
    if report.error:
        out.append(f"error: {printable(report.error)}")
    for a in report.agents:
        out.append("")
        out.append(f"{a.name}: {a.state}: {printable(a.reason)}")
        if a.unread:
            out.append(f"  (log not read: {printable(a.unread)})")
        if not a.findings:
            out.append("  no known failure in its log")
        for d in a.findings:
            kind = "fatal" if d.fatal else "error"
            times = f" ({d.count} lines)" if d.count > 1 else ""
            out.append(f"  [{d.signature}, {kind}]{times} {printable(d.cause)}")
            for line in d.lines:
                out.append(f"    {line.file}:{line.line}: {printable(line.text)}")
            out.append(f"    fix: {printable(d.fix)}")
    out.append("")
    out.append("nothing is wrong" if report.ok else "something is wrong (exit 1)")
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    """Print the report; exit 0 when nothing is wrong, else 1 (2: J is not a job)."""
    report = diagnose(open_job(args.job_dir))
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print(render(report))
    return EXIT_OK if report.ok else EXIT_RUNTIME
