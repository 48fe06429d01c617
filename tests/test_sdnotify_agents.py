"""Real agents on a ``--mock --dry-run`` job folder under a notification socket in systemd's place
(tests/kit/notifysocket.py): STATUS while loading, READY=1 only once serving, WATCHDOG=1 at its
pace and none while the loop is wedged, STOPPING=1 before the engines stop (docs/systemd.md).

The pace is read from the kernel's receive stamps and checked loosely ([0.2, 1.0] x
``WATCHDOG_USEC``); every wait has a bound.
"""

from __future__ import annotations

import itertools
import signal
from pathlib import Path

from agent.node.servicenotes import EXTEND_BY_S
from tests import kit
from tests.kit.checkpoint import checkpoint
from tests.kit.notifysocket import Note, abstract_address, index_of, listening, pets_after

WATCHDOG_S = 2.0
WEDGE_S = 4.0
LOAD_S = 2.0  # the stand-in decode "loads" this long before it binds its port


def test_worker_notes_load_ready_watchdog_wedge_stop(tmp_path: Path) -> None:
    """decode-0 under a 'systemd' socket: STATUS while loading, READY=1 only once healthy,
    WATCHDOG=1 at its pace and none while the loop is wedged, STOPPING=1 on SIGTERM before the
    engine stops; in that order."""
    job = kit.make_job(tmp_path, f"roles.decode.env.TILERT_MOCK_STARTUP_DELAY_S={LOAD_S}")
    address = abstract_address()
    with listening(address) as listener, kit.running_agents() as agents:
        agent = agents.start(
            job,
            "decode",
            0,
            NOTIFY_SOCKET=address,
            WATCHDOG_USEC=str(int(WATCHDOG_S * 1e6)),
            TILERT_AGENT_TEST_WEDGE_S=str(WEDGE_S),
        )
        notes = listener.wait("READY=1", lambda n: index_of(n, "READY") >= 0, 60)
        assert agent.status()["state"] == "healthy"
        ready = index_of(notes, "READY")
        loading = index_of(notes, "STATUS", "decode-0 starting")
        assert 0 <= loading < ready, [n.fields for n in notes]
        assert 0 <= index_of(notes, "EXTEND_TIMEOUT_USEC") < ready
        # Every new status while loading asks for more time.
        assert "EXTEND_TIMEOUT_USEC" in notes[loading].fields
        assert "decode-0 healthy" in notes[ready].fields["STATUS"]
        assert not [n for n in notes[:ready] if "healthy" in n.fields.get("STATUS", "")]
        # The watchdog's pace, once ready (kernel receive times).
        listener.wait("4 pets after READY", lambda n: len(pets_after(n, ready)) >= 4, 30)
        pets = pets_after(listener.seen(), ready)
        gaps = [b - a for a, b in itertools.pairwise(pets)]
        assert all(0.2 * WATCHDOG_S <= g <= 1.0 * WATCHDOG_S for g in gaps), gaps
        # Wedge the loop: no pet for WEDGE_S, then pets again.
        before = len(listener.with_key("WATCHDOG"))
        agent.signal(signal.SIGUSR2)
        kit.wait_for("the wedge to end", lambda: "runs again" in agent.agent_log.read_text(), 30)
        listener.wait("pets after the wedge", lambda n: len(pets_after(n, 0)) >= before + 2, 30)
        pets = pets_after(listener.seen(), 0)[before - 1 :]
        gaps = [b - a for a, b in itertools.pairwise(pets)]
        assert max(gaps) >= WEDGE_S - 0.05, gaps
        # SIGTERM: STOPPING=1 first, then the engine stops.
        agent.signal(signal.SIGTERM)
        assert agent.wait(30) == 0
        notes = listener.seen()
    stopping = index_of(notes, "STOPPING")
    assert ready < stopping, [n.fields for n in notes]
    engine_stops = index_of(notes, "STATUS", "decode-0 stopping")
    assert stopping < engine_stops, [n.fields for n in notes[stopping:]]
    assert index_of(notes, "STATUS", "decode-0 stopped") > engine_stops
    assert len([n for n in notes if "READY" in n.fields]) == 1


def test_conversion_and_load_extend_the_start(tmp_path: Path) -> None:
    """A decode converting its weights, then loading: STATUS says so, each with more time asked
    (EXTEND_TIMEOUT_USEC), and READY=1 comes only once the engine is healthy."""
    weights = tmp_path / "weights"
    hf = checkpoint(tmp_path / "hf")
    job = kit.make_job(
        tmp_path / "a",
        f"roles.decode.args.model-weights-dir={weights}",
        f"roles.decode.convert={{source: {hf}}}",
        "roles.decode.env.TILERT_MOCK_CONVERT_DELAY_S=0.5",
        f"roles.decode.env.TILERT_MOCK_STARTUP_DELAY_S={LOAD_S}",
    )
    address = abstract_address()
    with listening(address) as listener, kit.running_agents() as agents:
        agent = agents.start(job, "decode", 0, NOTIFY_SOCKET=address)
        notes = listener.wait("READY=1", lambda n: index_of(n, "READY") >= 0, 90)
        assert agent.status()["state"] == "healthy"
    ready = index_of(notes, "READY")
    converting = index_of(notes, "STATUS", "decode-0 converting")
    loading = index_of(notes, "STATUS", "decode-0 starting: engine pid")  # after the preflight
    assert 0 <= converting < loading < ready, [n.fields for n in notes]
    for note in (notes[converting], notes[loading]):
        assert note.fields["EXTEND_TIMEOUT_USEC"] == str(int(EXTEND_BY_S * 1e6)), note
    assert not [n for n in notes[:ready] if "READY" in n.fields]
    assert "EXTEND_TIMEOUT_USEC" not in notes[ready].fields  # ready: no more time asked


def head_engine_counted(notes: list[Note]) -> bool:
    """A job status that waits for decodes only: the head's own engine is healthy."""
    waits = [n.fields["STATUS"] for n in notes if "decode-0 (" in n.fields.get("STATUS", "")]
    return any("prefill-0" not in w for w in waits)


def test_head_ready_only_when_the_job_is(tmp_path: Path, router_python: Path) -> None:
    """prefill-0 says READY=1 only once the job is ready (canaries passed), not when its own
    engine turns healthy; then a chat is served."""
    sets, _ = kit.isolated_sets(router_python)
    job = kit.make_job(tmp_path, *sets[1::2])
    address = abstract_address()
    with listening(address) as listener, kit.running_agents() as agents:
        head = agents.start(job, "prefill", 0, NOTIFY_SOCKET=address)
        # The head has seen its engine healthy (no longer among those it waits for): not ready.
        notes = listener.wait("a status without prefill-0", head_engine_counted, 60)
        assert head.status()["state"] == "healthy"
        assert index_of(notes, "READY") < 0
        for index in (0, 1):
            agents.start(job, "decode", index)
        notes = listener.wait("READY=1", lambda n: index_of(n, "READY") >= 0, 90)
        status = kit.current_status(job)
        assert status["state"] == "ready", status
        ready = index_of(notes, "READY")
        assert notes[ready].fields["STATUS"].startswith("job ready: "), notes[ready]
        assert 0 <= index_of(notes, "STATUS", "job waiting") < ready
        assert "READY: " in head.agent_log.read_text()  # the canaries passed
        assert head.status()["state"] == "healthy"
        kit.check_chat(job)
        head.signal(signal.SIGTERM)
        assert head.wait(30) == 0
        notes = listener.seen()
    assert index_of(notes, "STOPPING") > ready
