"""The front door (agent/front/) of a local mock job with the REAL TileRT router: one stable
address that loses no request (docs/agent.md, "The front door"; docs/reliability.md).

The decodes are stand-ins with slow tokens (a chat streams for about 3 s), so an engine killed
under load is killed mid-stream. Clients here are unchanged OpenAI clients: they retry nothing
(``ChatLoad`` would retry a refused connection or a 429, and counts both: none may happen).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from agent.facts import derive_rid
from tests import kit
from tests.kit import FAST
from tests.kit.chatload import ChatLoad, stream_chat
from tests.kit.metrics import one, samples
from tests.kit.scenarios import ANSWER
from tests.test_scale import PROBE, scale

pytestmark = pytest.mark.router

READY_S = 120.0
TOKEN_DELAY = "roles.decode.env.TILERT_MOCK_TOKEN_DELAY_S=0.05"
SMALL_BODY = "agent.front.max_body_bytes=65536"
SHORT_BODY_WAIT = "agent.front.body_timeout_s=2"
MODEL = "demo-model"  # recipes/local-demo.yaml's served name
DECODES = ("decode-0", "decode-1")
# The kills each decode took in this module (its tests share one job): the kill under load takes
# the one killed fewer times of two streaming, so both decodes are killed and continued from.
KILLS: dict[str, int] = dict.fromkeys(DECODES, 0)
# Yet a cut stream's decode is the one that served it, and a decode streaming alone is killed
# whatever its count: up to all six kills of the module on one decode, past the default 5
# restarts in 600 s, after which its agent gives up and the job is degraded for the tests after.
KILLS_BUDGET = "agent.restart.max_restarts=20"
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64}


@pytest.fixture(scope="module")
def job(router_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[kit.LocalJob]:
    """One ready job for the module's tests (none of them changes its pool)."""
    sets, _ = kit.isolated_sets(
        router_python, *FAST, TOKEN_DELAY, PROBE, SMALL_BODY, SHORT_BODY_WAIT, KILLS_BUDGET
    )
    with kit.LocalJob(tmp_path_factory.mktemp("front") / "job", sets) as running:
        running.wait_state("ready", timeout=READY_S)
        yield running


def front(job: kit.LocalJob) -> str:
    """The job's front door URL (status.json ``front_url``)."""
    url = job.status()["front_url"]
    assert isinstance(url, str)
    return url


def front_figures(job: kit.LocalJob) -> dict[str, float]:
    """The head's tilert_front_requests_total by outcome, and tilert_front_in_flight."""
    url = kit.agent_entry(job.status(), "prefill-0")["metrics_url"]
    page = samples(httpx.get(url, timeout=5).text)
    out = {s.labels["outcome"]: s.value for s in page if s.name == "tilert_front_requests_total"}
    out["in_flight"] = one(page, "tilert_front_in_flight").value
    return out


def kill_engine(job: kit.LocalJob, name: str) -> int:
    """SIGKILL agent ``name``'s engine; its restarts before (``back_ready`` waits past them)."""
    before = kit.agent_status(kit.agent_entry(job.status(), name)["status_url"])
    psutil.Process(before["pid"]).kill()
    KILLS[name] += 1
    restarts = before["restarts"]
    assert isinstance(restarts, int)
    return restarts


def back_ready(job: kit.LocalJob, restarts: dict[str, int]) -> None:
    """status.json ``ready`` once the head has seen each killed decode restart (past its count
    in ``restarts``): right after a kill, status.json can still say ``ready`` from before it."""
    kit.wait_status(
        job.job,
        lambda s: (
            s["state"] == "ready"
            and all(kit.agent_entry(s, n)["restarts"] > r for n, r in restarts.items())
        ),
        f"ready again after the restarts of {sorted(restarts)}",
        READY_S,
    )


def current_rid(job: kit.LocalJob, name: str) -> str | None:
    """The request decode ``name`` serves now (its /decode_status), None when idle or down."""
    http = kit.record(job.job, name)["ports"]["http"]
    try:
        reply = httpx.get(f"http://127.0.0.1:{http}/decode_status", timeout=5)
    except httpx.HTTPError:
        return None
    rid = reply.json().get("current_rid") if reply.status_code == 200 else None
    return rid if isinstance(rid, str) else None


def streaming_decode(job: kit.LocalJob, settle_s: float = 0.5) -> str:
    """A decode serving the same request at two looks ``settle_s`` apart (a stream lasts about
    3 s): a kill now cuts a stream that has sent text, not one handed over between the looks
    before its first byte (a restarting decode is passed over). Of two streaming, the one killed
    fewer times (``kill_engine`` counts)."""

    def settled() -> str | None:
        order = sorted(DECODES, key=KILLS.__getitem__)
        first = {name: rid for name in order if (rid := current_rid(job, name)) is not None}
        if not first:
            return None
        time.sleep(settle_s)
        return next((name for name, rid in first.items() if current_rid(job, name) == rid), None)

    name = kit.wait_for("a decode streaming", settled, 60)
    assert name is not None
    return name


def decode_serving(job: kit.LocalJob, chunk_id: str) -> str:
    """The decode serving the stream whose chunks carry ``chunk_id`` (the router derives the
    request's rid at the decode from it): not a canary's or another client's."""
    rid = derive_rid(chunk_id)

    def serving() -> str | None:
        return next((name for name in DECODES if current_rid(job, name) == rid), None)

    name = kit.wait_for(f"the decode serving {rid}", serving, 30)
    assert name is not None
    return name


def settled_figures(job: kit.LocalJob) -> dict[str, float]:
    """``front_figures`` once nothing is in flight at the front: a stream's outcome is counted
    as its relay ends, a moment after the client got its last byte."""
    return kit.wait_for(
        "the front's requests ended",
        lambda: front_figures(job),
        30,
        until=lambda f: f["in_flight"] == 0,
    )


def events(lines: Iterator[str]) -> list[dict[str, Any] | str]:
    """Every SSE data payload of a streamed reply's lines (``[DONE]`` as the string)."""
    out: list[dict[str, Any] | str] = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_the_front_is_published_and_serves_models_and_usage(job: kit.LocalJob) -> None:
    """front_url in status.json, the head's record (ports.front), targets.json and ``status``;
    /v1/models answers the served name; a stream asked for usage ends with a usage chunk."""
    status = job.status()
    url = front(job)
    port = kit.record(job.job, "prefill-0")["ports"]["front"]
    assert url == f"http://127.0.0.1:{port}"
    assert url != status["router_url"]
    targets = json.loads((job.job / "prometheus" / "targets.json").read_text())
    assert {"agent": "prefill-0", "front_url": url} in [t["labels"] for t in targets]
    assert f"front: {url}" in kit.submit_cmd("status", str(job.job)).stdout
    models = httpx.get(f"{url}/v1/models", timeout=10).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [status["model"]]
    body = {**CHAT, "model": status["model"], "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        got = events(r.iter_lines())
    assert got[-1] == "[DONE]"
    usage = got[-2]
    assert isinstance(usage, dict)
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] > 0
    whole = httpx.post(
        f"{url}/v1/chat/completions", json={**CHAT, "model": status["model"]}, timeout=60
    )
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["message"]["content"]
    # status.json's counts are as fresh as its last write (on a change, and every 5 s).
    kit.wait_status(
        job.job, lambda s: s["front"]["requests"].get("ok", 0) >= 2, "the front's counts", 15
    )
    view = json.loads(kit.submit_cmd("status", str(job.job), "--json").stdout)
    assert view["status"]["front_url"] == url
    assert view["status"]["front"]["requests"]["ok"] >= 2
    assert "front requests: ok " in kit.submit_cmd("status", str(job.job)).stdout


def test_bad_input_gets_a_clear_4xx(job: kit.LocalJob) -> None:
    """A huge body 413 (declared or chunked), malformed JSON 400, what TileRT cannot serve 400,
    an endpoint it has no engine for 404: each in OpenAI's error shape, none reaching the
    router."""
    url = front(job)
    chat = f"{url}/v1/chat/completions"
    huge = b'{"x": "' + b"a" * 70000 + b'"}'
    cases = [
        (httpx.post(chat, content=huge, timeout=10), 413, "agent.front.max_body_bytes"),
        (httpx.post(chat, content=iter([huge[:40000], huge[40000:]]), timeout=10), 413, "larger"),
        (httpx.post(chat, content=b"{bad", timeout=10), 400, "not JSON"),
        (httpx.post(chat, content=b"[1]", timeout=10), 400, "JSON object"),
        (httpx.post(chat, json={**CHAT, "n": 2}, timeout=10), 400, "n=2"),
        (httpx.post(f"{url}/v1/embeddings", json={}, timeout=10), 404, "embeddings"),
    ]
    for response, status, word in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert word in error["message"], error
        assert error["type"]


def test_a_slow_client_and_a_client_gone_mid_stream_block_nothing(job: kit.LocalJob) -> None:
    """A client that never sends its body gets 408 after agent.front.body_timeout_s while other
    chats pass; a client that hangs up mid-stream frees its decode (the router cancels it)."""
    url = front(job)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as slow:
        slow.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        assert kit.chat_concurrently(url, MODEL, 2)  # served while the slow one waits
        reply = slow.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b"did not arrive within 2 s (agent.front.body_timeout_s)" in reply
    body = {**CHAT, "model": MODEL, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
    # Hung up: both decodes free again, nothing in flight at the front.
    kit.wait_for("the front and the decodes idle", lambda: front_figures(job)["in_flight"] == 0, 30)
    assert len(kit.chat_concurrently(url, MODEL, 2)) == 2
    assert front_figures(job)["cancelled"] >= 1


def cut_mid_stream(
    job: kit.LocalJob, body: dict[str, Any]
) -> tuple[list[dict[str, Any] | str], dict[str, int]]:
    """A streamed chat at the front whose decode is SIGKILLed after its first text: every
    event the client got, and the killed decode's restarts before (for ``back_ready``)."""
    got: list[dict[str, Any] | str] = []
    with httpx.stream("POST", f"{front(job)}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            got += events(iter([line]))
            if '"content"' in line and '"content": ""' not in line:
                break
        name = decode_serving(job, chunks_of(got)[0]["id"])
        killed = {name: kill_engine(job, name)}
        got += events(lines)
    return got, killed


def chunks_of(got: list[dict[str, Any] | str]) -> list[dict[str, Any]]:
    """The chunks among a stream's events (its ``[DONE]`` left out)."""
    return [e for e in got if isinstance(e, dict)]


def text_of(got: list[dict[str, Any] | str]) -> str:
    """A stream's text."""
    deltas = [c.get("delta") or {} for e in chunks_of(got) for c in e.get("choices") or []]
    return "".join(d.get("content") or "" for d in deltas)


def test_a_stream_cut_by_a_dead_decode_is_continued_whole(job: kit.LocalJob) -> None:
    """SIGKILL the decode serving a stream: the front continues it (agent.front.resume), and
    the client's stream is one: the uncut answer's text, one id, one role chunk, no error event,
    ``stop`` then the usage of the uncut answer, ``[DONE]``; the front counts it resumed."""
    body = {**CHAT, "model": MODEL, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{front(job)}/v1/chat/completions", json=body, timeout=60) as r:
        uncut = events(r.iter_lines())
    before = settled_figures(job)
    got, killed = cut_mid_stream(job, body)
    chunks = chunks_of(got)
    assert got[-1] == "[DONE]", got
    assert not [c for c in chunks if "error" in c], got
    assert text_of(got) == text_of(uncut) == ANSWER
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}, got
    roles = [c for e in chunks for c in e["choices"] if "role" in (c.get("delta") or {})]
    assert len(roles) == 1, got
    finishes = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["stop"], got
    assert (
        chunks[-1]["usage"]["completion_tokens"]
        == chunks_of(uncut)[-1]["usage"]["completion_tokens"]
    )
    after = settled_figures(job)
    assert (after["resumed"], after["truncated"]) == (before["resumed"] + 1, before["truncated"])
    back_ready(job, killed)


def test_a_cut_that_cannot_be_continued_is_marked_truncated(job: kit.LocalJob) -> None:
    """A chat with a response_format cannot be continued (its grammar would start again):
    its stream ends with the stream_truncated error event and [DONE], never a ``stop`` chunk;
    the front counts it truncated."""
    before = settled_figures(job)["truncated"]
    form = {"type": "json_object"}
    body = {**CHAT, "model": MODEL, "stream": True, "response_format": form}
    got, killed = cut_mid_stream(job, body)
    assert_marked(got)
    assert settled_figures(job)["truncated"] == before + 1
    back_ready(job, killed)


def assert_marked(got: list[dict[str, Any] | str]) -> None:
    """A cut stream as the client sees it without resume: the error event, then [DONE]."""
    assert got[-1] == "[DONE]"
    error = got[-2]
    assert isinstance(error, dict)
    assert error["error"]["type"] == "stream_truncated", error
    finishes = [c.get("finish_reason") for e in chunks_of(got) for c in e.get("choices") or []]
    assert not any(finishes), got
    assert text_of(got) != ANSWER


def finish_with_only_cuts(
    job: kit.LocalJob, load: ChatLoad, before: dict[str, float], most: int
) -> dict[str, float]:
    """End ``load`` and check what a fault under load may cost: nothing refused, busy or
    failed at the front, at most ``most`` chats cut, each with the visible stream_truncated
    error; the front's figures after."""
    load.finish()
    after = settled_figures(job)
    print(f"\nserved {load.served}, failures {load.failures}, front {before} -> {after}")
    assert not load.refused_at
    assert load.busy == 0
    assert len(load.failures) <= most, load.failures
    for failure in load.failures:
        assert "stream_truncated" in failure, failure
    assert after["failed"] == before["failed"]
    return after


def test_killed_decode_engines_under_load_lose_nothing(job: kit.LocalJob) -> None:
    """Three clients chatting while decode engines are SIGKILLed four times: nothing refused,
    nothing busy, no 5xx, nothing cut: every chat ends with [DONE] and the whole answer (the
    streams on a killed decode continued on another)."""
    url = front(job)
    before = settled_figures(job)
    load = ChatLoad(url, MODEL, clients=3, answer=ANSWER).start()
    killed: dict[str, int] = {}

    def served_at_least(count: int) -> None:
        kit.wait_for(f"{count} chats served", lambda: load.served >= count, 120)

    for kill in range(4):
        served_at_least(2 * (kill + 1))
        # Not the moment a chat was served: its decode has just been given the next request,
        # and a kill before that one's first byte is retried, not resumed.
        name = streaming_decode(job)
        killed[name] = kill_engine(job, name)
    served_at_least(12)
    after = finish_with_only_cuts(job, load, before, most=0)
    assert after["truncated"] == before["truncated"]
    assert after["resumed"] > before["resumed"]
    back_ready(job, killed)  # the module's next test meets a job proven again


def test_a_killed_router_under_load_refuses_nothing(job: kit.LocalJob) -> None:
    """SIGKILL the router while two clients chat: requests meanwhile wait for the restarted
    router (nothing refused, nothing failed); only the streams it was serving are cut, each
    with the visible stream_truncated error."""
    url = front(job)
    before = settled_figures(job)
    load = ChatLoad(url, MODEL, clients=2).start()
    kit.wait_for("chats served", lambda: load.served >= 2, 60)
    head = kit.agent_status(kit.agent_entry(job.status(), "prefill-0")["status_url"])
    psutil.Process(head["router"]["pid"]).kill()
    served = load.served
    kit.wait_for("chats after the router's restart", lambda: load.served >= served + 4, 120)
    finish_with_only_cuts(job, load, before, most=2)
    kit.wait_state(job.job, "ready", READY_S)


def test_a_hand_over_under_load_refuses_nothing(router_python: Path, tmp_path: Path) -> None:
    """``scale --decode 3`` then ``--decode 1`` (two router hand-overs each) while a client
    chats through the front: not one chat refused or failed; the front's address unchanged."""
    sets, _ = kit.isolated_sets(router_python, *FAST, TOKEN_DELAY, PROBE)
    with kit.LocalJob(tmp_path / "job", sets) as job:
        status = job.wait_state("ready", timeout=READY_S)
        url = status["front_url"]
        load = ChatLoad(url, status["model"], clients=2).start()
        for count in ("3", "1"):
            done = scale(job.job, "--decode", count)
            assert done.returncode == 0, done.stdout + done.stderr
        served = load.served
        kit.wait_for("chats after the hand-overs", lambda: load.served >= served + 2, 60)
        load.finish()
        assert job.status()["front_url"] == url
        head_log = (job.job / "logs" / "prefill-0" / "agent.log").read_text()
        assert head_log.count("restarting the router") >= 2
        print(f"\nserved {load.served} through 2 hand-overs; failures {load.failures}")
        assert not load.failures
        assert not load.refused_at
        assert load.busy == 0
        assert stream_chat(url, status["model"])["finish"]


def test_without_resume_a_cut_stream_is_marked_truncated(
    router_python: Path, tmp_path: Path
) -> None:
    """With ``agent.front.resume: false`` a stream cut by a dead decode is marked as before:
    the stream_truncated error event and [DONE], counted truncated."""
    sets, _ = kit.isolated_sets(router_python, *FAST, TOKEN_DELAY, "agent.front.resume=false")
    with kit.LocalJob(tmp_path / "job", sets) as running:
        running.wait_state("ready", timeout=READY_S)
        got, _ = cut_mid_stream(running, {**CHAT, "model": MODEL, "stream": True})
        assert_marked(got)
        after = settled_figures(running)
        assert (after["truncated"], after["resumed"]) == (1, 0)
