"""The chaos benchmark's pure parts: which faults, in which order (``parse_faults``,
``Schedule``), and what each cost the clients (``account``): no process, no clock of its own.

A request belongs to the last fault that struck before it ended (a request that ended before the
first fault belongs to the steady ``baseline``); it was *in flight* at its fault when it started
before the fault struck. The targets (issue 28): nothing lost to a decode-engine kill, a
decode-agent kill, a router hand-over (``scale``) or in the baseline; only requests in flight at
a decode kill may end truncated, and then with the visible ``stream_truncated`` error event, and
none at all while the front continues cut streams (``agent.front.resume``, issue 38); a
prefill or router SIGKILL loses at most the requests in flight at that moment (their streams ran
through the process that died). A silent cut (a stream that ends as if complete, its text short)
is a miss wherever it happens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

FaultKind = Literal["decode-engine", "prefill-engine", "decode-agent", "router", "scale"]
KINDS: tuple[FaultKind, ...] = (
    "decode-engine",
    "prefill-engine",
    "decode-agent",
    "router",
    "scale",
)
# A round of every fault, the order the benchmark runs them in by default (``--faults``).
DEFAULT_FAULTS = (
    "decode-engine:decode-0",
    "decode-engine:decode-2",
    "router",
    "prefill-engine",
    "decode-agent:decode-1",
    "scale:4",
    "scale:3",
)
# What a client's request came to: ``ok`` (the whole answer), ``failed`` (an HTTP error, a
# broken or timed-out stream, an error event other than ``stream_truncated``), ``truncated``
# (ended by the ``stream_truncated`` error event), ``cut`` (ended as if complete, text short).
Outcome = Literal["ok", "failed", "truncated", "cut"]


class BadFault(ValueError):
    """A ``--faults`` entry the benchmark does not know."""


@dataclass(frozen=True)
class Fault:
    """One fault: its kind and its target (a decode's name, the decode count of a ``scale``)."""

    kind: FaultKind
    target: str = ""

    @property
    def label(self) -> str:
        """``decode-engine:decode-0``, ``router``, ``scale:4``."""
        return f"{self.kind}:{self.target}" if self.target else self.kind

    @property
    def kills_a_decode(self) -> bool:
        """A decode engine dies (its streams may be cut, and must then be marked)."""
        return self.kind in ("decode-engine", "decode-agent")

    @property
    def kills_the_path(self) -> bool:
        """The prefill or the router dies: every stream through it at that moment may be lost."""
        return self.kind in ("prefill-engine", "router")


def parse_faults(text: str) -> list[Fault]:
    """``decode-engine:decode-0,router,scale:4`` as faults (raises ``BadFault`` naming the
    entry and the known kinds)."""
    out = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        kind, _, target = item.partition(":")
        if kind not in KINDS:
            raise BadFault(f"--faults: unknown fault {item!r}; known: {', '.join(KINDS)}")
        if kind in ("decode-engine", "decode-agent") and not target.startswith("decode-"):
            raise BadFault(f"--faults: {item!r} names no decode (e.g. {kind}:decode-0)")
        if kind == "scale" and not (target.isdigit() and int(target) >= 1):
            raise BadFault(f"--faults: {item!r} needs a decode count >= 1 (e.g. scale:4)")
        if kind in ("prefill-engine", "router") and target:
            raise BadFault(f"--faults: {item!r}: {kind} takes no target")
        out.append(Fault(kind, target))  # narrowed to a FaultKind by the check above
    if not out:
        raise BadFault("--faults: no fault given")
    return out


@dataclass
class Schedule:
    """The faults in order, round after round, while the run's time lasts: a fault starts only
    when ``elapsed`` (seconds since the load started) leaves room for it (``reserve_s``, its
    expected cost), and always at least one round's first fault."""

    faults: Sequence[Fault]
    duration_s: float
    reserve_s: float = 20.0
    started: int = 0

    def next(self, elapsed: float) -> Fault | None:
        """The next fault to strike now, or None once the run's time is spent."""
        if self.started and elapsed + self.reserve_s > self.duration_s:
            return None
        fault = self.faults[self.started % len(self.faults)]
        self.started += 1
        return fault


@dataclass(frozen=True)
class Request:
    """One client request as the client saw it (monotonic seconds)."""

    start: float
    end: float
    outcome: Outcome
    first_byte: float | None = None
    client_retries: int = 0  # refused connections and 429s the client itself sent again
    error: str = ""


@dataclass
class Struck:
    """One fault as it ran: when it struck, when the job was ``ready`` again (None: not within
    its bound), and the front's counters around it (empty without a front)."""

    fault: Fault
    at: float
    ready_at: float | None = None
    front_retries: float | None = None
    front_outcomes: dict[str, float] = field(default_factory=dict)
    note: str = ""


@dataclass
class Cost:
    """What one fault (or the baseline) cost the clients, and which targets it missed."""

    label: str
    requests: int = 0
    ok: int = 0
    lost: int = 0  # failed + cut
    truncated: int = 0
    cut: int = 0
    in_flight: int = 0
    client_retries: int = 0
    front_retries: float | None = None
    # Streams the front continued after a cut (its ``resumed`` outcome; None without a front).
    resumed: float | None = None
    ready_s: float | None = None
    # The longest any request of the fault took (start -> end): what waiting for a router being
    # handed over, or for a decode back, cost the clients.
    slowest_s: float | None = None
    # Requests answered whole per second while it lasted (its strike -> the next one's).
    ok_per_s: float | None = None
    misses: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def buckets(requests: Sequence[Request], struck: Sequence[Struck]) -> Iterator[list[Request]]:
    """The requests of the baseline, then of each fault in turn (``struck`` in time order)."""
    times = [s.at for s in struck]
    out: list[list[Request]] = [[] for _ in range(len(struck) + 1)]
    for r in requests:
        k = sum(1 for t in times if t < r.end)  # how many faults struck before it ended
        out[k].append(r)
    yield from out


def _misses(cost: Cost, fault: Fault | None, truncated_in_flight: int, resume: bool) -> list[str]:
    out = []
    where = fault.label if fault else "baseline"
    if cost.cut:
        out.append(f"{where}: {cost.cut} stream(s) cut silently (no error event)")
    failed = cost.lost - cost.cut
    if fault is not None and fault.kills_the_path:
        if failed + cost.truncated > cost.in_flight:
            out.append(
                f"{where}: {failed + cost.truncated} lost or truncated, more than the "
                f"{cost.in_flight} in flight when it struck"
            )
        return out
    if failed:
        out.append(f"{where}: {failed} request(s) lost")
    if fault is None or not fault.kills_a_decode:
        if cost.truncated:
            out.append(f"{where}: {cost.truncated} truncated, and no decode was killed")
    elif resume and cost.truncated:
        out.append(f"{where}: {cost.truncated} truncated, with the front continuing cut streams")
    elif cost.truncated > truncated_in_flight:
        out.append(f"{where}: {cost.truncated - truncated_in_flight} truncated, not in flight")
    return out


def account(
    requests: Sequence[Request], struck: Sequence[Struck], bound_s: float, *, resume: bool = False
) -> list[Cost]:
    """Per fault (the baseline first): requests, lost, truncated, resumed, retries, time back to
    ready, and the targets missed (``bound_s``: the bound a fault had to be ready again within;
    ``resume``: the front continues cut streams, so a decode kill may truncate none)."""
    costs = []
    last_end = max((r.end for r in requests), default=0.0)
    for k, group in enumerate(buckets(requests, struck)):
        s = struck[k - 1] if k else None
        cost = Cost(s.fault.label if s else "baseline", requests=len(group))
        for r in group:
            cost.ok += r.outcome == "ok"
            cost.truncated += r.outcome == "truncated"
            cost.cut += r.outcome == "cut"
            cost.lost += r.outcome in ("failed", "cut")
            cost.client_retries += r.client_retries
            if r.outcome != "ok" and r.error and r.error not in cost.errors:
                cost.errors.append(r.error)
        cost.slowest_s = max((r.end - r.start for r in group), default=None)
        flying = [r for r in group if s is not None and r.start < s.at]
        cost.in_flight = len(flying)
        truncated_in_flight = sum(r.outcome == "truncated" for r in flying)
        cost.misses = _misses(cost, s.fault if s else None, truncated_in_flight, resume)
        if s is not None:
            until = struck[k].at if k < len(struck) else last_end
            if until > s.at:
                cost.ok_per_s = cost.ok / (until - s.at)
            cost.front_retries = s.front_retries
            if s.front_retries is not None:  # the front's counters were read
                cost.resumed = s.front_outcomes.get("resumed", 0.0)
            if s.ready_at is None:
                cost.misses.append(f"{s.fault.label}: not ready again within {bound_s:g} s")
            else:
                cost.ready_s = s.ready_at - s.at
        costs.append(cost)
    return costs


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if digits else f"{value:g}"


def render(costs: Sequence[Cost]) -> str:
    """The per-fault table the benchmark prints."""
    header = [
        "fault",
        "requests",
        "ok",
        "lost",
        "truncated",
        "resumed",
        "in flight",
        "client retries",
        "front retries",
        "back to ready s",
        "slowest s",
        "ok/s",
        "met",
    ]
    rows = [header]
    for c in costs:
        rows.append(
            [
                c.label,
                str(c.requests),
                str(c.ok),
                str(c.lost),
                str(c.truncated),
                _cell(c.resumed, 0),
                str(c.in_flight),
                str(c.client_retries),
                _cell(c.front_retries, 0),
                _cell(c.ready_s),
                _cell(c.slowest_s),
                _cell(c.ok_per_s),
                "no" if c.misses else "yes",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
