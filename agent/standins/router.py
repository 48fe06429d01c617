"""Stand-in for TileRT's P/D router (``python -m tilert.pd_vllm.pd_router``) where that cannot run.

Same flags (``--decode`` is ONE flag with nargs="+": repeating it keeps only the last), same
endpoints in miniature: ``/health`` (always 200 with ``decode_free``), ``/pool_status``,
``POST /v1/chat/completions`` (SSE or not) and ``POST /v1/completions`` (not streamed). A request
takes the first idle decode node (or waits ``--queue-timeout``, else 429), asks vLLM for one
token with ``kv_transfer_params`` naming that node, then streams ``/pd/decode`` from it. Tokens
become text with ``tokenizers`` when ``--model-path`` holds a tokenizer.json and the library is
importable, else with the stand-ins' fixed byte mapping. Exits: bad flag 2, bad ``--decode`` 1,
port in use 3, SIGTERM 143.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from agent.facts import ROUTER_PARSERS, derive_rid
from agent.standins import lifecycle, openai_api, tokens
from agent.standins.failmodes import print_failure
from agent.standins.faults import Crasher, Faults
from agent.web.asgi import (
    App,
    Request,
    Response,
    StreamingResponse,
    json_response,
)
from agent.web.server import bound_socket, serve

log = logging.getLogger("pd_vllm.router")

TERM_EXIT_CODE = 143
PORT_IN_USE_EXIT_CODE = 3
DEFAULT_MAX_TOKENS = 256
BUSY_RETRY_S = 0.5
_DROPPED = ("stream_options", "max_completion_tokens", "stop", "include_stop_str_in_output")


def build_parser() -> argparse.ArgumentParser:
    """pd_router's flags."""
    ap = argparse.ArgumentParser(prog="pd_router", allow_abbrev=False, epilog=lifecycle.HELP_EPILOG)
    ap.add_argument("--vllm-url", required=True)
    ap.add_argument(
        "--decode", nargs="+", required=True, help="decode nodes as host:ctrl_port:http_port"
    )
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=23333)
    ap.add_argument("--model-path", default="")
    ap.add_argument("--parser", choices=ROUTER_PARSERS, default="glm47")
    ap.add_argument("--model", default="")
    ap.add_argument("--queue-timeout", type=float, default=0.0)
    ap.add_argument("--force-include-usage", action="store_true")
    return ap


@dataclass
class Node:
    host: str
    ctrl_port: int
    http_port: int
    busy: bool = False

    @property
    def http_base(self) -> str:
        return f"http://{self.host}:{self.http_port}"


def parse_nodes(specs: list[str]) -> list[Node]:
    """``host:ctrl:http`` specs; ValueError names a bad one."""
    nodes = []
    for spec in specs:
        try:
            host, ctrl, http = spec.rsplit(":", 2)
            nodes.append(Node(host, int(ctrl), int(http)))
        except ValueError:
            raise ValueError(f"--decode {spec!r}: want host:ctrl_port:http_port") from None
    return nodes


class Pool:
    """Decode nodes, one request each; the first idle one in --decode order wins."""

    def __init__(self, nodes: list[Node], queue_timeout: float) -> None:
        self.nodes = nodes
        self.queue_timeout = queue_timeout
        self._released = trio.Event()

    async def acquire(self) -> Node | None:
        """An idle node, marked busy; None after the queue timeout."""
        with trio.move_on_after(self.queue_timeout):
            while True:
                for node in self.nodes:
                    if not node.busy:
                        node.busy = True
                        return node
                await self._released.wait()
        return None

    def release(self, node: Node) -> None:
        """Give a node back."""
        node.busy = False
        self._released.set()
        self._released = trio.Event()


def load_detokenizer(model_path: str) -> Callable[[list[int]], str]:
    """Token ids -> text: the tokenizer under --model-path if usable, else the fixed mapping."""
    path = Path(model_path) / "tokenizer.json" if model_path else None
    if path is not None and path.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            log.info("tokenizers is not importable: rendering tokens with the fixed byte mapping")
        else:
            tokenizer = Tokenizer.from_file(str(path))
            return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))
    return tokens.render


class Router:
    """The router's request handling."""

    def __init__(
        self, args: argparse.Namespace, pool: Pool, detok: Callable[[list[int]], str]
    ) -> None:
        self.vllm_url = args.vllm_url.rstrip("/")
        self.pool = pool
        self.detok = detok
        self.force_usage = args.force_include_usage
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=10.0))

    def build_app(self) -> App:
        """The HTTP app."""
        app = App()

        @app.route("GET", "/health")
        async def health(_request: Request) -> Response:
            free = sum(1 for n in self.pool.nodes if not n.busy)
            return json_response({"status": "ok", "decode_free": free})

        @app.route("GET", "/pool_status")
        async def pool_status(_request: Request) -> Response:
            return json_response(
                {"nodes": [{"host": n.host, "busy": n.busy} for n in self.pool.nodes]}
            )

        @app.route("POST", "/v1/chat/completions")
        async def chat(request: Request) -> Response | StreamingResponse:
            return await self.handle("/v1/chat/completions", await request.json())

        @app.route("POST", "/v1/completions")
        async def completions(request: Request) -> Response | StreamingResponse:
            body = await request.json()
            if isinstance(body, dict) and body.get("stream"):
                return json_response(
                    {"error": "streaming is supported on /v1/chat/completions"}, 400
                )
            return await self.handle("/v1/completions", body)

        return app

    async def prefill(
        self, path: str, body: dict[str, Any], node: Node
    ) -> dict[str, Any] | Response:
        """One token from vLLM, its KV sent to ``node``; a Response when vLLM refuses."""
        pbody = {k: v for k, v in body.items() if k not in _DROPPED}
        pbody.update(max_tokens=1, stream=False)
        if path.endswith("chat/completions"):
            pbody.update(logprobs=True, top_logprobs=max(1, int(body.get("top_logprobs") or 0)))
        else:
            pbody["logprobs"] = 1
        pbody["kv_transfer_params"] = {"tilert_host": node.host, "tilert_ctrl_port": node.ctrl_port}
        r = await self.client.post(f"{self.vllm_url}{path}", json=pbody)
        if 400 <= r.status_code < 500:
            return Response(
                r.content, r.status_code, r.headers.get("content-type", "application/json")
            )
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    @staticmethod
    def first_token(prefill: dict[str, Any], is_chat: bool) -> int:
        """The first token id, from the ``token_id:N`` logprob."""
        lp = prefill["choices"][0].get("logprobs") or {}
        tok = (
            (lp.get("content") or [{}])[0].get("token")
            if is_chat
            else (lp.get("tokens") or [None])[0]
        )
        if isinstance(tok, str) and tok.startswith("token_id:"):
            return int(tok.split(":", 1)[1])
        raise ValueError(
            f"cannot extract first token id from logprobs ({tok!r}); launch vLLM with "
            "--return-tokens-as-token-ids and request logprobs"
        )

    async def open_decode(self, node: Node, payload: dict[str, Any]) -> httpx.Response:
        """POST /pd/decode (streamed), retrying a 429 once after 0.5 s."""
        for attempt in (1, 2):
            req = self.client.build_request("POST", f"{node.http_base}/pd/decode", json=payload)
            resp = await self.client.send(req, stream=True)
            if resp.status_code != 429 or attempt == 2:
                return resp
            await resp.aclose()
            log.info(
                "decode node %s busy for %s, retrying in %.1fs",
                node.http_base,
                payload["rid"],
                BUSY_RETRY_S,
            )
            await trio.sleep(BUSY_RETRY_S)
        raise AssertionError("unreachable")

    async def handle(self, path: str, body: Any) -> Response | StreamingResponse:
        """Prefill, then decode on the leased node."""
        if not isinstance(body, dict):
            return json_response({"error": "request body must be a JSON object"}, 400)
        refused = _refused(body)
        if refused is not None:
            return json_response({"error": refused, "error_type": "capability_unavailable"}, 501)
        is_chat = path.endswith("chat/completions")
        node = await self.pool.acquire()
        if node is None:
            detail = (
                "no decode node free" if self.pool.queue_timeout > 0 else "all decode nodes busy"
            )
            return json_response({"error": detail}, 429)
        handed_off = False
        try:
            t0 = time.monotonic()
            try:
                prefill = await self.prefill(path, body, node)
                if isinstance(prefill, Response):
                    return prefill
                rid = derive_rid(prefill["id"])
                first = self.first_token(prefill, is_chat)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                log.exception("pd request failed")
                return json_response({"error": str(exc)}, 502)
            payload = {
                "rid": rid,
                "first_token_id": first,
                "max_tokens": openai_api.max_tokens(body, DEFAULT_MAX_TOKENS),
                "sampling": openai_api.sampling(body),
                "stream": True,
            }
            try:
                resp = await self.open_decode(node, payload)
            except httpx.HTTPError as exc:
                return json_response({"error": str(exc)}, 502)
            if resp.status_code != 200:
                return await _decode_refusal(resp, rid)
            usage_prompt = int((prefill.get("usage") or {}).get("prompt_tokens") or 0)
            if is_chat and body.get("stream"):
                handed_off = True
                return StreamingResponse(
                    self.sse(node, rid, resp, prefill, body, usage_prompt),
                    content_type="text/event-stream",
                )
            return await self.whole(resp, prefill, is_chat, usage_prompt, t0)
        finally:
            if not handed_off:
                self.pool.release(node)

    async def whole(
        self,
        resp: httpx.Response,
        prefill: dict[str, Any],
        is_chat: bool,
        usage_prompt: int,
        t0: float,
    ) -> Response:
        """The non-streamed OpenAI reply from the whole decode stream."""
        ids, finish, error = await self.collect(resp)
        if error is not None:
            return json_response(error, 502)
        text = self.detok(ids)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if is_chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return json_response(
            {
                "id": prefill["id"],
                "object": openai_api.object_name(is_chat),
                "created": int(time.time()),
                "model": prefill.get("model"),
                "choices": [choice],
                "usage": _usage(usage_prompt, len(ids)),
                "timing_ms": {"total": round(1000 * (time.monotonic() - t0), 1)},
            }
        )

    @staticmethod
    async def lines(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
        """The decode node's NDJSON messages."""
        async for line in resp.aiter_lines():
            if line.strip():
                yield msgspec.json.decode(line)

    async def collect(self, resp: httpx.Response) -> tuple[list[int], str, dict[str, Any] | None]:
        """All tokens of a decode stream, its finish reason, and an error if it failed."""
        ids: list[int] = []
        try:
            async for msg in self.lines(resp):
                if "t" in msg:
                    ids += msg["t"]
                elif msg.get("done"):
                    if msg.get("n") is not None and msg["n"] != len(ids):
                        return (
                            ids,
                            "stop",
                            {"error": f"decode node declared {msg['n']} tokens, sent {len(ids)}"},
                        )
                    return ids, _finish(msg.get("finish_reason")), None
                elif "error" in msg:
                    return ids, "stop", msg
        finally:
            await resp.aclose()
        return (
            ids,
            "stop",
            {
                "error": "decode stream ended without a terminal message",
                "error_type": "decode_truncated",
            },
        )

    async def sse(
        self,
        node: Node,
        rid: str,
        resp: httpx.Response,
        prefill: dict[str, Any],
        body: dict[str, Any],
        usage_prompt: int,
    ) -> AsyncIterator[bytes]:
        """The client's SSE stream; frees the node (and cancels the decode) however it ends."""
        stream = openai_api.ChunkStream(
            prefill["id"],
            openai_api.chunk_object_name(is_chat=True),
            int(time.time()),
            prefill.get("model"),
        )

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return stream.event([{"index": 0, "delta": delta, "finish_reason": finish}])

        ids: list[int] = []
        text = ""
        finished = False
        try:
            yield chunk({"role": "assistant", "content": ""})
            finish = "stop"
            async for msg in self.lines(resp):
                if "t" in msg:
                    ids += msg["t"]
                    full = self.detok(ids)
                    if len(full) > len(text) and not full.endswith("\ufffd"):
                        yield chunk({"content": full[len(text) :]})
                        text = full
                elif msg.get("done"):
                    finished = True
                    finish = _finish(msg.get("finish_reason"))
                    break
                elif "error" in msg:
                    finished = True
                    yield chunk({"content": f"\n[decode error: {msg['error']}]"})
                    break
            yield chunk({}, finish)
            if self.force_usage or openai_api.include_usage(body):
                usage = _usage(usage_prompt, len(ids))
                yield openai_api.sse_event({"id": prefill["id"], "choices": [], "usage": usage})
            yield openai_api.SSE_DONE
        finally:
            with trio.CancelScope(shield=True):
                await resp.aclose()
                if not finished:
                    with contextlib.suppress(httpx.HTTPError), trio.move_on_after(5):
                        await self.client.post(f"{node.http_base}/pd/cancel", json={"rid": rid})
            self.pool.release(node)


def _refused(body: dict[str, Any]) -> str | None:
    """Why TileRT's router refuses a request outright (``capabilities.py``), or None.

    Only ``min_tokens`` is checked here: the decode loop cannot suppress its stop set for a
    minimum length, so a benchmark client must ask for ``ignore_eos`` instead.
    """
    value = body.get("min_tokens")
    if value is None or value == 0:
        return None
    return (
        "min_tokens is not supported by the TileRT decode stage: the decode loop cannot suppress "
        "its stop set for a minimum length. The vLLM prefill instance would apply it to the "
        "first token and the decode node would ignore it for the rest of the reply, so the "
        "request is refused instead of served incorrectly."
    )


async def _decode_refusal(resp: httpx.Response, rid: str) -> Response:
    """The router's answer when the decode node refused ``rid`` (busy: 429, else 502)."""
    await resp.aread()
    await resp.aclose()
    if resp.status_code == 429:
        return json_response(
            {"error": "decode node busy", "error_type": "decode_busy", "rid": rid}, 429
        )
    return json_response(
        {"error": "decode call failed", "status": resp.status_code, "rid": rid}, 502
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """A reply's usage, in TileRT's router order (``build_usage``)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _finish(reason: Any) -> str:
    return "stop" if reason in (None, "cancelled") else str(reason)


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m agent.standins.router --vllm-url URL --decode h:c:p ...``."""
    lifecycle.setup_logging("%(asctime)s %(name)s %(message)s")
    args = lifecycle.parse_known(build_parser(), argv)
    try:
        nodes = parse_nodes(args.decode)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    detok = load_detokenizer(args.model_path)
    try:
        sock = bound_socket(args.host, args.port)
    except OSError as exc:
        log.error("cannot bind %s:%d: %s", args.host, args.port, exc)
        raise SystemExit(PORT_IN_USE_EXIT_CODE) from None

    # Of the switches only TILERT_MOCK_FAILURE: the router is not a GPU engine.
    failure = lifecycle.load_faults().failure

    async def body(_nursery: trio.Nursery, _crasher: Crasher, shutdown: trio.Event) -> None:
        print_failure(failure, "router", "start")
        print_failure(failure, "router", "serve")
        router = Router(args, Pool(nodes, args.queue_timeout), detok)
        log.info(
            "router on :%d -> vllm=%s, %d decode node(s), parser=%s (stand-in)",
            args.port,
            args.vllm_url,
            len(nodes),
            args.parser,
        )
        try:
            await serve(router.build_app(), sock, shutdown=shutdown)
        finally:
            with trio.CancelScope(shield=True):
                await router.client.aclose()

    lifecycle.run("router", Faults(), body, term_exit_code=TERM_EXIT_CODE)


if __name__ == "__main__":
    main()
