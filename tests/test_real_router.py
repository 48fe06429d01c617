"""The REAL TileRT router (tilert 0.1.6.post3, Python 3.12 venv) on the stand-ins: 1 prefill + 2
decode.

The router is started by hand with the unchanged production command, no GPU visible, and the demo
tokenizer (recipes/local-demo-model) as --model-path. The prefill stand-in's ``/tokenize`` lets the
router turn its router-side tokenization on, so both of its prefill paths are taken: chats it can
render go to ``/v1/completions`` as token ids, the others to ``/v1/chat/completions``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.standins import tokens
from tests.infra.ports import free_port
from tests.infra.standin_stack import (
    DEMO_MODEL,
    Proc,
    decode_argv,
    prefill_argv,
    standin_env,
    wait_http,
)

pytestmark = pytest.mark.router

REPLY = tokens.FIRST_TOKEN_TEXT + tokens.CONTINUATION_TEXT
NO_GPU = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": ""}


class RealRouterStack:
    def __init__(self, router_python: Path, tmp: Path) -> None:
        self.procs: list[Proc] = []
        self.decodes = [(free_port(), free_port()) for _ in range(2)]
        prefill_port, self.router_port = free_port(), free_port()
        # A token delay keeps each decode busy long enough for two requests to overlap.
        delay = {"TILERT_MOCK_TOKEN_DELAY_S": "0.03"}
        for i, (http, ctrl) in enumerate(self.decodes):
            env = standin_env(TILERT_AGENT_NAME=f"decode-{i}", **delay)
            self.procs.append(Proc(decode_argv(http, ctrl), env, tmp / f"decode-{i}.log"))
        self.procs.append(Proc(prefill_argv(prefill_port), standin_env(), tmp / "prefill.log"))
        router = [str(router_python), "-m", "tilert.pd_vllm.pd_router"]
        router += ["--vllm-url", f"http://127.0.0.1:{prefill_port}", "--decode"]
        router += [f"127.0.0.1:{ctrl}:{http}" for http, ctrl in self.decodes]
        router += ["--host", "127.0.0.1", "--port", str(self.router_port)]
        router += ["--model-path", str(DEMO_MODEL), "--parser", "none"]
        env = standin_env(**NO_GPU, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.pop("PYTHONPATH")  # the router's venv must not see this project
        self.router = Proc(router, env, tmp / "router.log")
        self.procs.append(self.router)
        urls = [f"http://127.0.0.1:{http}/health" for http, _ in self.decodes]
        urls += [f"http://127.0.0.1:{prefill_port}/health", f"{self.url}/health"]
        for proc, url in zip(self.procs, urls, strict=True):
            wait_http(url, proc, timeout=60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def decode_log(self, i: int) -> str:
        return self.procs[i].output()

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture(scope="module")
def real_router(
    router_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealRouterStack]:
    stack = None
    try:
        stack = RealRouterStack(router_python, tmp_path_factory.mktemp("real-router"))
        yield stack
    finally:
        if stack is not None:
            stack.stop()


def stream_chat(url: str) -> str:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_router_started_with_the_real_code(real_router: RealRouterStack) -> None:
    log = real_router.router.output()
    assert "router on :" in log
    assert "2 decode node(s)" in log
    assert "(stand-in)" not in log
    assert httpx.get(f"{real_router.url}/health").json() == {"status": "ok", "decode_free": 2}


def test_streaming_chat_returns_text(real_router: RealRouterStack) -> None:
    assert stream_chat(real_router.url) == REPLY


def test_concurrent_requests_use_both_decode_nodes(real_router: RealRouterStack) -> None:
    before = [real_router.decode_log(i).count("REQSTAT") for i in range(2)]
    texts: list[str] = []
    threads = [
        threading.Thread(target=lambda: texts.append(stream_chat(real_router.url)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert texts == [REPLY, REPLY]
    after = [real_router.decode_log(i).count("REQSTAT") for i in range(2)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]


def test_non_streaming_completion(real_router: RealRouterStack) -> None:
    body = {"model": "demo", "prompt": "once upon a time", "max_tokens": 8}
    r = httpx.post(f"{real_router.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == REPLY[:8]
    assert choice["finish_reason"] == "length"
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{real_router.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == REPLY


def router_tokenize(url: str) -> dict[str, object]:
    """The router's router-side tokenization figures (``/pool_status``)."""
    status = httpx.get(f"{url}/pool_status", timeout=10).json()
    figures: dict[str, object] = status["router_tokenize"]
    return figures


def test_the_router_takes_both_of_its_prefill_paths(real_router: RealRouterStack) -> None:
    # The stand-in's /tokenize matches the router's own tokenizer on every self-check probe, so
    # the router turns router-side tokenization on, as it does against a real vLLM.
    deadline = time.monotonic() + 30
    while not router_tokenize(real_router.url)["on"]:
        assert time.monotonic() < deadline, real_router.router.output()[-2000:]
        time.sleep(0.2)
    assert "router-side tokenization ON" in real_router.router.output()
    before = router_tokenize(real_router.url)["requests"]
    # A chat without logprobs: token ids to the prefill's /v1/completions.
    assert stream_chat(real_router.url) == REPLY
    assert router_tokenize(real_router.url)["requests"] == before + 1  # type: ignore[operator]
    # A chat the router cannot render itself (a message with a name) falls back to the
    # prefill's /v1/chat/completions.
    message = {"role": "user", "content": "hi", "name": "tester"}
    chat = {"model": "demo", "messages": [message]}
    r = httpx.post(f"{real_router.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == REPLY
    figures = router_tokenize(real_router.url)
    assert (figures["requests"], figures["fallback"]) == (before + 2, 1)  # type: ignore[operator]


def chunks_and_text(reply: str) -> tuple[list[dict[str, Any]], str]:
    """A streamed reply's chunks (``[DONE]`` left out) and its text."""
    lines = [line[6:] for line in reply.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    events = [json.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c["choices"])
    return events, text


def test_a_continued_answer_reaches_the_prefill_and_goes_on_where_it_was_cut(
    real_router: RealRouterStack,
) -> None:
    # What the front door sends after a cut (agent.front.resume): the conversation plus the text
    # already sent as an open assistant turn. The router sends it down its chat path (it does not
    # render continue_final_message itself) and the stand-ins continue the answer from there.
    sent = REPLY[:8]
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": sent}]
    body = {
        "model": "demo",
        "messages": messages,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 64 - len(sent),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    before = router_tokenize(real_router.url)
    r = httpx.post(f"{real_router.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    events, text = chunks_and_text(r.text)
    assert text == REPLY[len(sent) :]
    assert events[-1]["usage"]["completion_tokens"] == len(REPLY) - len(sent) + 1  # and EOS
    after = router_tokenize(real_router.url)
    if before["on"]:  # router-side tokenization on: the continuation fell back to the chat path
        assert after["fallback"] == before["fallback"] + 1  # type: ignore[operator]
    # The budget is the continuation's own: it stops where the whole answer would have.
    r = httpx.post(
        f"{real_router.url}/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=60
    )
    events, text = chunks_and_text(r.text)
    assert text == REPLY[len(sent) : len(sent) + 4]
