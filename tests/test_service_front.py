"""The service front (agent/service/front.py) before real cells: local mock jobs
(``tilert-submit --local --mock`` with the real TileRT router, decodes whose chats stream for
about 3 s),
a ``ServiceFront`` on a real socket in the test process (tests/kit/servicefront.py) whose table the
test sets as the cell keeper would, and clients that are plain OpenAI streaming clients (they
retry nothing: every request they see fail is one the service lost).

Streaming chats spread over both cells; one cell leaving the table mid-load finishes its streams
while new requests go to the other, none lost; a cell frozen (SIGSTOP) and ``cut`` has its streams
under way continued at the other cell (``agent.front.relay``: the conversation plus the text
already sent, through the real router to the prefill), each client seeing one whole stream, the
uncut answer's text; its request that had no byte yet is served by another cell, and the other
cell's clients see nothing.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil
import pytest

from tests import kit
from tests.kit import FAST
from tests.kit.servicefront import FrontThread, cell_record

READY_S = 120.0
LOAD_S = 120.0
TOKEN_DELAY = "roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S=0.05"
MODEL = "demo-model"  # recipes/local-demo.yaml's served name
CELLS = ("cell-1", "cell-2")


@dataclass
class Chat:
    """One streamed chat as its client saw it."""

    status: int
    text: str = ""
    finish: str | None = None
    done: bool = False
    error: dict[str, Any] | None = None
    body: str = ""
    ids: set[str] = field(default_factory=set)  # the chunks' ids (one stream: one id)
    roles: int = 0  # role chunks (one stream: one)

    @property
    def ok(self) -> bool:
        """Answered whole: a finish reason and [DONE], no error event."""
        return self.status == 200 and self.finish is not None and self.done and not self.error

    @property
    def marked(self) -> bool:
        """Cut, and said so: the ``stream_truncated`` error event, then [DONE]."""
        return self.done and (self.error or {}).get("type") == "stream_truncated"


def chat(url: str, started: threading.Event | None = None) -> Chat:
    """One streamed chat at ``url`` (``started`` set once text arrived)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 64,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        got = Chat(response.status_code)
        if response.status_code != 200:
            got.body = response.read().decode(errors="replace")
            return got
        for line in response.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if data == "[DONE]":
                got.done = True
            elif data:
                event = json.loads(data)
                got.error = event.get("error") or got.error
                got.ids |= {event["id"]} if "id" in event else set()
                got.roles += any(
                    (c.get("delta") or {}).get("role") for c in event.get("choices") or []
                )
                for choice in event.get("choices") or []:
                    got.text += (choice.get("delta") or {}).get("content") or ""
                    got.finish = choice.get("finish_reason") or got.finish
                if started is not None and got.text:
                    started.set()
    return got


@dataclass
class Load:
    """``clients`` threads chatting one streamed chat after another until ``finish``."""

    url: str
    clients: int
    chats: list[Chat] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                got = chat(self.url)
            except httpx.HTTPError as exc:
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                continue
            with self._lock:
                self.chats.append(got)
                if not got.ok:
                    self.failures.append(repr(got))

    def start(self) -> Load:
        """Start the clients."""
        for _ in range(self.clients):
            thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def finish(self) -> None:
        """Stop the clients once their current chats are done."""
        self.stop.set()
        for thread in self._threads:
            thread.join(LOAD_S)


def local_job(path: Path, router_python: Path) -> kit.LocalJob:
    """A cell: ``tilert-submit --local --mock`` with the real router and slow tokens."""
    args, _ = kit.isolated_sets(router_python, *FAST, TOKEN_DELAY)
    return kit.LocalJob(path, args)


@pytest.fixture(scope="module")
def cells(
    router_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[kit.LocalJob, kit.LocalJob]]:
    """Two ready cells, shared by the module's tests (none of them stops either)."""
    root = tmp_path_factory.mktemp("cells")
    with (
        local_job(root / "cell-1", router_python) as one,
        local_job(root / "cell-2", router_python) as two,
    ):
        one.wait_state("ready", timeout=READY_S)
        two.wait_state("ready", timeout=READY_S)
        yield one, two


@dataclass
class ServiceFrontView:
    """The front's counts, read in its loop."""

    svc: FrontThread

    def served(self, name: str) -> int:
        return self.svc.front.served(name)

    def in_flight(self, name: str) -> int:
        return self.svc.front.in_flight(name)


def until(svc: FrontThread, what: str, condition: Callable[[ServiceFrontView], bool]) -> None:
    """Wait (bounded) until ``condition`` holds of the front (read in its own loop)."""
    kit.wait_for(what, lambda: svc.call(lambda: condition(ServiceFrontView(svc))), LOAD_S)


def test_streams_spread_over_both_cells_and_a_cell_leaving_loses_none(
    cells: tuple[kit.LocalJob, kit.LocalJob],
) -> None:
    one, two = cells
    with FrontThread() as svc:
        front = svc.front
        svc.call(front.set_cells, [cell_record("cell-1", one), cell_record("cell-2", two)])
        models = httpx.get(f"{svc.url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        load = Load(svc.url, clients=4).start()
        try:
            until(svc, "chats served by both cells", lambda f: min(map(f.served, CELLS)) >= 2)
            until(svc, "a stream under way at cell-1", lambda f: f.in_flight("cell-1") > 0)
            table = [cell_record("cell-1", one, "retiring"), cell_record("cell-2", two)]

            def retire() -> tuple[int, int]:
                front.set_cells(table)  # from here cell-1 takes nothing new
                return front.in_flight("cell-1"), front.served("cell-1")

            left, served = svc.call(retire)
            assert left > 0
            until(svc, "cell-1's streams to finish", lambda f: f.in_flight("cell-1") == 0)
            assert svc.call(front.served, "cell-1") == served + left  # each of them whole
            then = svc.call(front.served, "cell-2")
            until(svc, "more chats at cell-2", lambda f: f.served("cell-2") >= then + 4)
            assert svc.call(front.served, "cell-1") == served + left  # nothing new went there
        finally:
            load.finish()
        requests = svc.call(front.requests)
    assert load.failures == []
    assert all(c.ok and c.text for c in load.chats)
    assert requests["ok"] + requests["retried_ok"] == len(load.chats) >= 8
    assert {k: v for k, v in requests.items() if k not in ("ok", "retried_ok") and v} == {}


def freeze(job: kit.LocalJob) -> None:
    """Every process of the job stopped (SIGSTOP): its front door answers nothing more."""
    job.remember_tree()
    for proc in job.seen.values():
        with contextlib.suppress(psutil.Error):
            proc.suspend()


def test_a_cell_frozen_and_cut_has_its_streams_continued_whole_at_another(
    cells: tuple[kit.LocalJob, kit.LocalJob], router_python: Path, tmp_path: Path
) -> None:
    survivor = cells[0]
    with local_job(tmp_path / "cell-3", router_python) as doomed, FrontThread() as svc:
        doomed.wait_state("ready", timeout=READY_S)
        front = svc.front
        cell = cell_record("cell-3", doomed, decodes=2)
        svc.call(front.set_cells, [cell])
        got: dict[str, Chat] = {}
        started = {tag: threading.Event() for tag in ("s1", "s2")}

        def client(tag: str) -> threading.Thread:
            def run() -> None:
                got[tag] = chat(svc.url, started.get(tag))

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            return thread

        threads = [client("s1"), client("s2")]
        for tag, event in started.items():
            assert event.wait(LOAD_S), f"{tag} never began"
        freeze(doomed)
        # One more to the frozen cell (the table says it has room): no byte will come.
        svc.call(front.set_cells, [msgspec.structs.replace(cell, decodes=3)])
        threads.append(client("s3"))
        until(svc, "s3 at the frozen cell", lambda f: f.in_flight("cell-3") == 3)
        bigger = msgspec.structs.replace(cell, decodes=3)
        svc.call(front.set_cells, [cell_record("cell-1", survivor), bigger])
        threads.append(client("s4"))
        until(svc, "s4 at cell-1", lambda f: f.in_flight("cell-1") + f.served("cell-1") == 1)
        svc.call(front.cut, "cell-3")
        deadline = time.monotonic() + LOAD_S  # one bound for them all
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert set(got) == {"s1", "s2", "s3", "s4"}, f"unanswered: {got}"
        requests = svc.call(front.requests)
        assert svc.call(front.in_flight, "cell-3") == 0
    for tag in ("s1", "s2", "s3", "s4"):
        assert got[tag].ok, got[tag]  # whole: a finish reason, [DONE], no error event
        assert (len(got[tag].ids), got[tag].roles) == (1, 1), got[tag]  # one stream
    # Continued where they were cut: the uncut answer's text (the stand-ins' tokens are the
    # same for the same conversation), through the real router to the prefill and back.
    assert got["s1"].text == got["s2"].text == got["s4"].text
    assert {k: v for k, v in requests.items() if v} == {"ok": 1, "retried_ok": 1, "resumed": 2}
