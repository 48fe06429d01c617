"""The stand-in engines as real processes on 127.0.0.1: endpoints, wire protocol, faults, exits."""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from agent.facts import DECODE_KV_LAYOUT, PREFILL_KV_LAYOUT, TILERT_MODELS, derive_rid
from agent.node.ports import is_bindable
from agent.standins import kvlink, tokens, wire
from agent.standins.faults import FaultConfigError, Faults
from tests.infra.ports import free_port
from tests.infra.standin_stack import (
    DEMO_MODEL,
    Proc,
    decode_argv,
    prefill_argv,
    standin_env,
    wait_http,
)
from tests.kit import wait_for

REPLY = tokens.FIRST_TOKEN_TEXT + tokens.CONTINUATION_TEXT
# How long a decode waits for a KV that never comes, in the test that checks what it answers
# meanwhile: a window the checks must land in, on a loaded machine too.
KV_WAIT_S = 5.0
# How long a stand-in "loads" (its ports unbound) in the test that checks them meanwhile.
LOAD_S = 6.0
# How soon a decode whose client hung up is idle again (its whole reply takes 19 s there).
HANG_UP_S = 5.0


class Stack:
    """One prefill, two decodes and the router stand-in."""

    def __init__(self, tmp: Path) -> None:
        self.procs: list[Proc] = []
        self.prefill_port = free_port()
        self.decodes = [(free_port(), free_port()) for _ in range(2)]
        self.router_port = free_port()
        self.tmp = tmp

    def start(self) -> None:
        for i, (http, ctrl) in enumerate(self.decodes):
            argv = decode_argv(http, ctrl, "--some-future-flag", "x")
            env = standin_env(TILERT_AGENT_NAME=f"decode-{i}")
            self.procs.append(Proc(argv, env, self.tmp / f"decode-{i}.log"))
        self.procs.append(
            Proc(prefill_argv(self.prefill_port), standin_env(), self.tmp / "prefill.log")
        )
        specs = [f"127.0.0.1:{ctrl}:{http}" for http, ctrl in self.decodes]
        router = [sys.executable, "-m", "agent.standins.router", "--vllm-url", self.prefill_url]
        router += ["--decode", *specs, "--host", "127.0.0.1", "--port", str(self.router_port)]
        router += ["--model-path", str(DEMO_MODEL), "--parser", "none"]
        self.procs.append(Proc(router, standin_env(), self.tmp / "router.log"))
        for proc, url in zip(self.procs, self.health_urls(), strict=True):
            wait_http(url, proc)

    @property
    def prefill_url(self) -> str:
        return f"http://127.0.0.1:{self.prefill_port}"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def decode_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.decodes[i][0]}"

    def health_urls(self) -> list[str]:
        return [
            *(f"{self.decode_url(i)}/health" for i in range(2)),
            f"{self.prefill_url}/health",
            f"{self.router_url}/health",
        ]

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("stack"))
    try:
        s.start()
        yield s
    finally:
        s.stop()


# Starts a stand-in process (argv, extra env) that the fixture stops at teardown.
Spawn = Callable[..., "Proc"]


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start extra stand-in processes; all are stopped at teardown."""
    procs: list[Proc] = []

    def start(argv: list[str], **env: str) -> Proc:
        proc = Proc(argv, standin_env(**env), tmp_path / f"proc-{len(procs)}.log")
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.stop()


def chat(base: str, ctrl_port: int | None = None, **extra: object) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    }
    body.update(logprobs=True, top_logprobs=1)
    if ctrl_port is not None:
        body["kv_transfer_params"] = {"tilert_host": "127.0.0.1", "tilert_ctrl_port": ctrl_port}
    body.update(extra)
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    return cast(dict[str, Any], r.json())


def ndjson(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


# --- prefill -----------------------------------------------------------------------------------


def test_prefill_endpoints(stack: Stack) -> None:
    r = httpx.get(f"{stack.prefill_url}/health")
    assert (r.status_code, r.content) == (200, b"")
    models = httpx.get(f"{stack.prefill_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["demo"]
    assert httpx.post(f"{stack.prefill_url}/tokenize", json={}).status_code == 400
    # /tokenize answers with the demo tokenizer's ids (tests/test_real_router.py checks them
    # against the router's own tokenizer), the chat template applied.
    said = httpx.post(
        f"{stack.prefill_url}/tokenize",
        json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]},
    ).json()
    # <|im_start|> user \n hi <|im_end|> \n <|im_start|> assistant \n
    im_start = tokens.SPECIAL_TOKENS.index(tokens.BOS_TOKEN)
    assert said["tokens"][0] == im_start
    assert said["tokens"].count(im_start) == 2
    assert said["tokens"].count(tokens.EOS_ID) == 1
    assert said["count"] == len(said["tokens"])
    assert said["max_model_len"] == 4096
    plain = httpx.post(f"{stack.prefill_url}/tokenize", json={"prompt": "hi"}).json()
    assert 1 <= plain["count"] <= 2
    reply = chat(stack.prefill_url)
    assert reply["id"].startswith("chatcmpl-")
    assert (
        reply["choices"][0]["logprobs"]["content"][0]["token"]
        == f"token_id:{tokens.first_token_id()}"
    )
    comp = httpx.post(
        f"{stack.prefill_url}/v1/completions",
        json={"model": "demo", "prompt": "hi", "max_tokens": 1, "logprobs": 1},
    ).json()
    assert comp["id"].startswith("cmpl-")
    assert comp["choices"][0]["logprobs"]["tokens"] == [f"token_id:{tokens.first_token_id()}"]
    wrong = httpx.post(
        f"{stack.prefill_url}/v1/chat/completions", json={"model": "nope", "messages": []}
    )
    assert wrong.status_code == 404


def test_prefill_streams_when_asked(stack: Stack) -> None:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": True,
    }
    r = httpx.post(f"{stack.prefill_url}/v1/chat/completions", json=body)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == REPLY[:5]


def test_metrics_move_with_requests(stack: Stack) -> None:
    def scrape() -> dict[tuple[str, str], float]:
        r = httpx.get(f"{stack.prefill_url}/metrics")
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        out = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                assert family.name.startswith("vllm:") is False or s.labels.get("engine") == "0"
                out[(s.name, s.labels.get("finished_reason", ""))] = s.value
        return out

    before = scrape()
    chat(stack.prefill_url)
    after = scrape()
    assert after[("vllm:prompt_tokens_total", "")] > before[("vllm:prompt_tokens_total", "")]
    assert (
        after[("vllm:generation_tokens_total", "")]
        == before[("vllm:generation_tokens_total", "")] + 1
    )
    success = ("vllm:request_success_total", "length")
    assert after[success] == before[success] + 1
    ttft = ("vllm:time_to_first_token_seconds_count", "")
    assert after[ttft] == before[ttft] + 1
    assert ("vllm:e2e_request_latency_seconds_count", "") in after
    assert ("vllm:num_requests_running", "") in after
    assert ("vllm:kv_cache_usage_perc", "") in after


# --- decode and the ctrl-port handshake
# ------------------------------------------------------------


def test_decode_endpoints_and_unknown_flags(stack: Stack) -> None:
    assert httpx.get(f"{stack.decode_url(0)}/health").json() == {"status": "ok"}
    caps = httpx.get(f"{stack.decode_url(0)}/capabilities").json()
    assert caps["engine"] != "StubEngine"
    assert caps["profile"] == "glm5"
    assert set(caps["capabilities"]) >= {"penalties", "ignore_eos"}
    assert httpx.get(f"{stack.decode_url(0)}/decode_status").json() == {
        "status": "idle",
        "current_rid": None,
    }
    assert "--some-future-flag x" in stack.procs[0].output()
    assert "control plane listening on" in stack.procs[0].output()


def test_handshake_then_streamed_decode(stack: Stack) -> None:
    _http, ctrl = stack.decodes[0]
    reply = chat(stack.prefill_url, ctrl)
    rid = derive_rid(reply["id"])
    first = int(reply["choices"][0]["logprobs"]["content"][0]["token"].split(":")[1])
    body = {"rid": rid, "first_token_id": first, "max_tokens": 100, "stream": True, "timeout_s": 10}
    r = httpx.post(f"{stack.decode_url(0)}/pd/decode", json=body, timeout=20)
    assert r.status_code == 200, r.text
    lines = ndjson(r)
    ids = [t for line in lines[:-1] for t in line["t"]]
    done = lines[-1]
    assert done["done"] is True
    assert done["n"] == len(ids)
    assert done["finish_reason"] == "stop"
    assert done["seq_len"] == reply["usage"]["prompt_tokens"]
    assert tokens.render(ids) == REPLY
    log = stack.procs[0].output()
    assert f"request {rid}: all ranks done" in log
    assert "(8/8)" in log


def test_non_streamed_decode_is_cut_at_max_tokens(stack: Stack) -> None:
    _http, ctrl = stack.decodes[0]
    reply = chat(stack.prefill_url, ctrl)
    body = {
        "rid": derive_rid(reply["id"]),
        "first_token_id": tokens.first_token_id(),
        "max_tokens": 4,
    }
    r = httpx.post(f"{stack.decode_url(0)}/pd/decode", json=body, timeout=20)
    out = r.json()
    assert tokens.render(out["token_ids"]) == REPLY[:4]
    assert out["timing_ms"]["finish_reason"] == "length"


def test_busy_429_and_kv_timeout_504(stack: Stack) -> None:
    url = f"{stack.decode_url(1)}/pd/decode"
    results: list[httpx.Response] = []
    # The first request holds decode-1 for its KV wait: long enough that the poll below and the
    # second request land inside it on a loaded machine (with 1 s, a poll or a second request a
    # second late found decode-1 idle again, and the second was admitted, not refused).
    body = {"rid": "never-sent", "first_token_id": 1, "timeout_s": KV_WAIT_S}
    waiting = threading.Thread(
        target=lambda: results.append(httpx.post(url, json=body, timeout=KV_WAIT_S + 20))
    )
    waiting.start()
    wait_for(
        "decode-1 busy with the first request",
        lambda: httpx.get(f"{stack.decode_url(1)}/decode_status").json()["status"] == "busy",
        KV_WAIT_S,
        interval=0.02,
    )
    second = httpx.post(url, json={"rid": "other", "first_token_id": 1}, timeout=10)
    assert second.status_code == 429
    assert second.json()["error"] == "busy"
    waiting.join(KV_WAIT_S + 20)
    assert results[0].status_code == 504
    assert results[0].json() == {"error": "kv_transfer_timeout", "rid": "never-sent"}
    assert httpx.get(f"{stack.decode_url(1)}/decode_status").json()["status"] == "idle"


def test_hang_up_clears_busy_and_cancel(spawn: Spawn) -> None:
    http, ctrl = free_port(), free_port()
    # A whole reply takes 38 tokens x 0.5 s: the node idle within HANG_UP_S is the hang-up's
    # doing, with room for a loaded machine (0.2 s a token left 2 s of a 7.6 s reply).
    proc = spawn(decode_argv(http, ctrl), TILERT_MOCK_NO_KV="1", TILERT_MOCK_TOKEN_DELAY_S="0.5")
    base = f"http://127.0.0.1:{http}"
    wait_http(f"{base}/health", proc)
    body = {"rid": "r1", "first_token_id": tokens.first_token_id(), "stream": True}
    with httpx.stream("POST", f"{base}/pd/decode", json=body, timeout=10) as r:
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
        assert json.loads(next(lines)) == {"t": [tokens.first_token_id()]}
        assert httpx.get(f"{base}/decode_status").json() == {"status": "busy", "current_rid": "r1"}
    wait_for(
        "the node idle after the client hung up (else the hang-up left it busy)",
        lambda: httpx.get(f"{base}/decode_status").json()["status"] == "idle",
        HANG_UP_S,
    )
    assert httpx.post(f"{base}/pd/cancel", json={"rid": "nope"}).status_code == 404
    with httpx.stream("POST", f"{base}/pd/decode", json={**body, "rid": "r2"}, timeout=10) as r:
        lines = r.iter_lines()
        next(lines)
        assert httpx.post(f"{base}/pd/cancel", json={"rid": "r2"}).json() == {"cancelled": "r2"}
        rest = [json.loads(line) for line in lines if line]
    assert rest[-1]["done"]
    assert rest[-1]["finish_reason"] == "cancelled"
    proc.signal(signal.SIGTERM)
    assert proc.wait(5) == 143


def _frame(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _read(sock: socket.socket) -> dict[str, Any]:
    buf = b""
    while len(buf) < 4:
        buf += sock.recv(4 - len(buf))
    (n,) = struct.unpack("!I", buf)
    data = b""
    while len(data) < n:
        data += sock.recv(n - len(data))
    return cast(dict[str, Any], json.loads(data))


def test_wire_protocol_refusals(spawn: Spawn) -> None:
    http, ctrl = free_port(), free_port()
    proc = spawn(decode_argv(http, ctrl, "--max-seq-len", "100"), TILERT_PD_SENDERS="2")
    wait_http(f"http://127.0.0.1:{http}/health", proc)

    def connect() -> tuple[socket.socket, dict[str, Any]]:
        sock = socket.create_connection(("127.0.0.1", ctrl), timeout=5)
        return sock, _read(sock)

    sock, hello = connect()
    assert hello["magic"] == "tilert-pd"
    assert hello["protocol_version"] == 2
    assert hello["layout_version"] == 10
    assert hello["transport"] == "mooncake"
    assert (hello["senders"], hello["max_seq_len"], hello["busy"]) == (2, 100, False)
    _frame(sock, {"rid": "a", "rank": 0, "seq_len": 101, "last_prompt_token": 1})
    assert _read(sock)["error"] == "seq_len exceeds max_seq_len"
    sock.close()
    sock, _ = connect()
    _frame(sock, {"rid": "a", "rank": 0, "seq_len": 10})
    ack = _read(sock)
    assert ack["accepted"] is True
    assert ack["rid"] == "a"
    assert ack["rank"] == 0
    _frame(sock, {"done": True, "rid": "a", "rank": 0, "generation": ack["generation"]})
    sock.close()
    sock, _ = connect()
    _frame(sock, {"rid": "a", "rank": 0, "seq_len": 10})
    assert _read(sock)["error"] == "duplicate_rank"
    sock.close()
    holder, _ = connect()
    _frame(holder, {"rid": "a", "rank": 1, "seq_len": 10})
    assert _read(holder)["accepted"] is True  # rank 1 is writing, so "a" holds the slot
    sock, hello = connect()
    assert hello["busy"] is True
    _frame(sock, {"rid": "b", "rank": 0, "seq_len": 10})
    assert _read(sock)["error"] == "busy"
    sock.close()
    holder.close()


def test_layout_versions_and_rid() -> None:
    assert set(wire.PROFILE_LAYOUT) == set(TILERT_MODELS)
    assert set(wire.LAYOUT_OFFSET) == set(DECODE_KV_LAYOUT.values())
    assert set(PREFILL_KV_LAYOUT.values()) <= set(wire.LAYOUT_OFFSET)
    assert wire.layout_version("glm5", "fp8_ds_mla", DECODE_KV_LAYOUT) == 10
    assert wire.layout_version("glm5", "bfloat16", DECODE_KV_LAYOUT) == 50
    assert wire.layout_version("dsv32", "bf16", DECODE_KV_LAYOUT) == 51
    assert wire.layout_version("glm5_2", "fp8_rocm", DECODE_KV_LAYOUT) == 212
    # Each side by its own table: vLLM's "fp8" is the flat (ROCm) layout, TileRT's is fp8 MLA.
    assert wire.layout_version("glm5", "fp8", PREFILL_KV_LAYOUT) == 210
    assert wire.layout_version("glm5", "fp8", DECODE_KV_LAYOUT) == 10
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        wire.layout_version("glm5", "int4", DECODE_KV_LAYOUT)
    assert derive_rid("chatcmpl-abc123-0-1a2b3c4d") == "abc123"
    assert derive_rid("cmpl-deadbeef") == "cmpl-deadbeef"[5:]


async def test_kvlink_sender_and_receiver_in_process(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    receiver = kvlink.Receiver(layout_version=10, transport="mooncake", max_seq_len=100, senders=2)
    listeners = await nursery.start(trio.serve_tcp, receiver.handle, 0)
    port = listeners[0].socket.getsockname()[1]
    config = kvlink.ConnectorConfig(
        host=None,
        ctrl_port=port,
        profile="glm5",
        transport="mooncake",
        admission_attempts=2,
        layout_version=10,
        senders=2,
        ranks=(0, 1),
        tensor_parallel_size=2,
    )
    sender = kvlink.Sender(config, nursery, no_kv=False)
    await sender.send(kvlink.Transfer("r1", "127.0.0.1", port, 10, {"temperature": 0.5}))
    slot = await receiver.wait_complete("r1", 5, trio.Event())
    assert slot is not None
    assert slot.done_ranks == {0, 1}
    assert slot.seq_len == 10
    receiver.release("r1")
    # A decode that does not match is refused before admission, and nothing is admitted.
    other = kvlink.Sender(dataclasses.replace(config, transport="nixl"), nursery, no_kv=False)
    await other.send(kvlink.Transfer("r2", "127.0.0.1", port, 10, {}))
    assert "transport mismatch: decode=mooncake vs prefill=nixl" in caplog.text
    too_long = kvlink.Transfer("r3", "127.0.0.1", port, 101, {})
    await sender.send(too_long)
    assert "seq 101 exceeds decode max_seq_len 100" in caplog.text
    assert receiver.current is None
    assert not receiver.completed


# --- router stand-in ---------------------------------------------------------------------------


def test_router_standin_serves_both_paths(stack: Stack) -> None:
    assert httpx.get(f"{stack.router_url}/health").json() == {"status": "ok", "decode_free": 2}
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    r = httpx.post(f"{stack.router_url}/v1/chat/completions", json=body, timeout=20)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == REPLY
    plain = httpx.post(
        f"{stack.router_url}/v1/chat/completions", json={**body, "stream": False}, timeout=20
    )
    assert plain.json()["choices"][0]["message"]["content"] == REPLY
    comp = httpx.post(
        f"{stack.router_url}/v1/completions", json={"model": "demo", "prompt": "x"}, timeout=20
    )
    assert comp.json()["choices"][0]["text"] == REPLY
    assert httpx.get(f"{stack.router_url}/health").json()["decode_free"] == 2


def test_router_standin_repeated_decode_keeps_last(spawn: Spawn) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "agent.standins.router", "--vllm-url", "http://127.0.0.1:1"]
    argv += ["--decode", "127.0.0.1:1:2", "--decode", "127.0.0.1:3:4", "--host", "127.0.0.1"]
    proc = spawn([*argv, "--port", str(port)])
    wait_http(f"http://127.0.0.1:{port}/health", proc)
    assert len(httpx.get(f"http://127.0.0.1:{port}/pool_status").json()["nodes"]) == 1
    proc.signal(signal.SIGTERM)
    assert proc.wait(5) == 143
    bad = spawn(
        [sys.executable, "-m", "agent.standins.router", "--vllm-url", "x", "--decode", "nope"]
    )
    assert bad.wait(10) == 1


# --- fault switches ----------------------------------------------------------------------------


def test_fault_target_selects_one_engine() -> None:
    env = {"TILERT_MOCK_CRASH_AFTER_S": "3", "TILERT_MOCK_FAULT_TARGET": "decode-1"}
    assert Faults.from_env({**env, "TILERT_AGENT_NAME": "decode-0"}) == Faults()
    assert Faults.from_env({**env, "TILERT_AGENT_NAME": "decode-1"}).crash_after_s == 3.0
    assert Faults.from_env({"TILERT_MOCK_EXIT_CODE": "0"}).exit_code == 0
    assert Faults.from_env({}).exit_code == 1


def test_fault_starts_limit_the_switches_to_the_first_starts(tmp_path: Path) -> None:
    # A decode that crash-loops, then heals: the count outlives the engine and its agent.
    env = {
        "TILERT_MOCK_CRASH_AFTER_REQUESTS": "1",
        "TILERT_MOCK_FAULT_STARTS": "2",
        "TILERT_MOCK_FAULT_STARTS_FILE": str(tmp_path / "starts"),
    }
    seen = [Faults.from_env(env).crash_after_requests for _ in range(4)]
    assert seen == [1, 1, None, None]
    assert (tmp_path / "starts").read_bytes() == b"...."
    with pytest.raises(FaultConfigError, match="TILERT_MOCK_FAULT_STARTS_FILE"):
        Faults.from_env({"TILERT_MOCK_FAULT_STARTS": "1"})


def test_startup_delay_keeps_port_free(spawn: Spawn) -> None:
    http, ctrl = free_port(), free_port()
    # Long enough that the checks below come before the load ends on a loaded machine (with
    # 1.5 s the port could be bound by the time they ran).
    proc = spawn(decode_argv(http, ctrl), TILERT_MOCK_STARTUP_DELAY_S=str(LOAD_S))
    wait_for("the stand-in to start loading", lambda: "loading TileRT engine" in proc.output(), 10)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{http}/health", timeout=1)
    assert is_bindable(ctrl)
    wait_http(f"http://127.0.0.1:{http}/health", proc)


def test_crash_after_requests_exit_zero_like_vllm(spawn: Spawn) -> None:
    port = free_port()
    proc = spawn(
        prefill_argv(port), TILERT_MOCK_CRASH_AFTER_REQUESTS="1", TILERT_MOCK_EXIT_CODE="0"
    )
    wait_http(f"http://127.0.0.1:{port}/health", proc)
    chat(f"http://127.0.0.1:{port}")
    assert proc.wait(5) == 0
    assert "EngineDeadError" in proc.output()


def test_crash_after_seconds_only_for_the_target(spawn: Spawn) -> None:
    target = {"TILERT_MOCK_CRASH_AFTER_S": "0.5", "TILERT_MOCK_FAULT_TARGET": "decode-1"}
    ports = [(free_port(), free_port()) for _ in range(2)]
    victim = spawn(decode_argv(*ports[0]), TILERT_AGENT_NAME="decode-1", **target)
    bystander = spawn(decode_argv(*ports[1]), TILERT_AGENT_NAME="decode-0", **target)
    assert victim.wait(10) == 1
    assert "stand-in fault" in victim.output()
    wait_http(f"http://127.0.0.1:{ports[1][0]}/health", bystander)
    assert bystander.popen.poll() is None


def test_hang_health(spawn: Spawn) -> None:
    http, ctrl = free_port(), free_port()
    proc = spawn(decode_argv(http, ctrl), TILERT_MOCK_HANG_HEALTH="1")
    wait_http(f"http://127.0.0.1:{http}/capabilities", proc)
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(f"http://127.0.0.1:{http}/health", timeout=0.5)


def test_prefill_no_kv_metrics_file_and_sigterm(stack: Stack, spawn: Spawn, tmp_path: Path) -> None:
    port = free_port()
    metrics = tmp_path / "metrics.txt"
    argv = [a for a in prefill_argv(port, "--enforce-eager") if a != "--return-tokens-as-token-ids"]
    proc = spawn(argv, TILERT_MOCK_NO_KV="1", TILERT_MOCK_METRICS_FILE=str(metrics))
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/health", proc)
    assert httpx.get(f"{base}/metrics").status_code == 500
    metrics.write_text("# a page\nvllm:x 1\n")
    r = httpx.get(f"{base}/metrics")
    assert r.text == "# a page\nvllm:x 1\n"
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    metrics.write_text("vllm:x 2\n")
    assert httpx.get(f"{base}/metrics").text == "vllm:x 2\n"
    _http, ctrl = stack.decodes[1]
    reply = chat(base, ctrl)
    assert reply["choices"][0]["logprobs"]["content"][0]["token"] == tokens.FIRST_TOKEN_TEXT
    body = {"rid": derive_rid(reply["id"]), "first_token_id": 1, "timeout_s": 0.5}
    assert httpx.post(f"{stack.decode_url(1)}/pd/decode", json=body, timeout=10).status_code == 504
    assert "--enforce-eager" in proc.output()
    proc.signal(signal.SIGTERM)
    assert proc.wait(5) == 0
