"""Stand-in for TileRT's decode server (``python -m tilert.pd_vllm.decode_server``).

Same flags, same HTTP app (``/health``, ``/capabilities``, ``/decode_status``, ``POST /pd/decode``,
``POST /pd/cancel``), same control plane on the ctrl port (``agent.standins.kvlink.Receiver``),
same startup lines and exit codes (SIGTERM 143, startup error 1). Both ports are bound on the
address it finds for itself, the agent's (TileRT binds ``('::', port)``, every address): a
``--local`` job listens on 127.0.0.1 only. The "engine" answers ``[first_token_id]`` + a short
fixed reply in the demo tokenizer's byte ids (``agent.standins.tokens``), ending with EOS, cut at
``max_tokens``.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from agent.facts import (
    DECODE_KV_DEFAULT,
    DECODE_KV_LAYOUT,
    DEFAULT_DECODE_MAX_SEQ_LEN,
    DEFAULT_TILERT_MODEL,
    DEFAULT_TRANSPORT,
    NUM_MTP_CHOICES,
    TRANSPORTS,
)
from agent.standins import lifecycle, tokens, wire
from agent.standins.faults import Crasher, Faults
from agent.standins.kvlink import Receiver
from agent.standins.tilertlog import FORMAT, TileRTFormatter
from agent.web.asgi import (
    App,
    Request,
    Response,
    StreamingResponse,
    json_response,
)
from agent.web.server import bound_socket, serve

log = logging.getLogger("pd_vllm.decode_server")
recv_log = logging.getLogger("pd_vllm.receive")

TERM_EXIT_CODE = 143
DEFAULT_HTTP_PORT = 5557


def build_parser() -> argparse.ArgumentParser:
    """TileRT decode_server's flags, with its defaults and choices."""
    ap = argparse.ArgumentParser(
        prog="decode_server", allow_abbrev=False, epilog=lifecycle.HELP_EPILOG
    )
    ap.add_argument("--engine", choices=["stub", "tilert"], default="stub")
    ap.add_argument("--model", default=DEFAULT_TILERT_MODEL, help="model profile")
    ap.add_argument("--max-seq-len", type=int, default=DEFAULT_DECODE_MAX_SEQ_LEN)
    ap.add_argument("--ctrl-port", type=int, default=wire.DEFAULT_CTRL_PORT)
    ap.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT)
    ap.add_argument("--model-weights-dir", default="")
    ap.add_argument("--with-mtp", action="store_true")
    ap.add_argument("--num-mtp", type=int, choices=NUM_MTP_CHOICES, default=NUM_MTP_CHOICES[0])
    ap.add_argument("--transport", choices=TRANSPORTS, default=DEFAULT_TRANSPORT)
    ap.add_argument("--kv-cache-dtype", default=DECODE_KV_DEFAULT)
    ap.add_argument(
        "--pd-buffer-device",
        choices=["cuda", "cpu"],
        default=(os.environ.get("TILERT_PD_BUFFER_DEVICE") or "cuda").lower(),
    )
    return ap


class DecodeBody(msgspec.Struct):
    rid: str
    first_token_id: int
    max_tokens: int = 256
    sampling: dict[str, Any] | None = None
    timeout_s: float = 120.0
    stream: bool = False
    grammar_spec: dict[str, Any] | None = None
    enable_thinking: bool = True
    top_logprobs: int | None = None


@dataclass(frozen=True)
class EngineKind:
    """What /capabilities reports for an engine."""

    name: str
    penalties: bool
    ignore_eos: bool
    logprobs: bool


# The stub mirrors TileRT's StubEngine; "tilert" mirrors its MLA/NSA engine adapter.
ENGINES = {
    "stub": EngineKind("StubEngine", penalties=True, ignore_eos=True, logprobs=True),
    "tilert": EngineKind("StandInTileRTEngine", penalties=False, ignore_eos=True, logprobs=False),
}


@dataclass
class DecodeState:
    """The one in-flight decode request (TileRT serves one at a time)."""

    current_rid: str | None = None
    cancel: trio.Event | None = None


def _plan(
    first_token_id: int,
    max_tokens: int,
    ignore_eos: bool,
    table: list[int] | None = None,
    at: int = 0,
) -> tuple[list[int], str]:
    """The tokens to emit and the finish reason: the model's greedy continuation by ``table``
    (``TILERT_MOCK_NEXT_TOKENS``), else the fixed reply after its token ``at`` (the first
    token's place in it: 0, or where a continued answer's context left it)."""
    if table is not None:
        ids = tokens.continued(first_token_id, table, max(1, max_tokens))
    elif first_token_id == tokens.EOS_ID:
        ids = [first_token_id]
    else:
        rest = tokens.reply_ids(at + 1, max(0, max_tokens - 1), ignore_eos=ignore_eos)
        ids = [first_token_id, *rest]
    return ids, "stop" if ids[-1] == tokens.EOS_ID else "length"


def _fake_logprob(token_id: int) -> float:
    return -0.5 - 0.25 * (token_id % 4)


def _unsupported(sampling: dict[str, Any], kind: EngineKind) -> str | None:
    """Why the engine cannot honour ``sampling`` (TileRT's capability check), or None."""
    penalties = (
        float(sampling.get("repetition_penalty") or 1.0) != 1.0
        or float(sampling.get("presence_penalty") or 0.0) != 0.0
    )
    if penalties and not kind.penalties:
        return "repetition/presence penalties are not supported by this model's decode runtime"
    if sampling.get("ignore_eos") and not kind.ignore_eos:
        return "ignore_eos is not supported by this model's decode loop"
    return None


def _refusal(body: DecodeBody, kind: EngineKind) -> Response | None:
    """The 501 for what this engine cannot do (logprobs, sampling), or None."""
    if body.top_logprobs is not None and not kind.logprobs:
        log.info("logprobs requested but unsupported by %s (rid=%s)", kind.name, body.rid)
        return json_response(
            {
                "error": f"{kind.name} does not produce logprobs",
                "error_type": "logprobs_unavailable",
            },
            501,
        )
    why = _unsupported(body.sampling or {}, kind)
    if why is not None:
        log.info("sampling rejected for %s: %s (%s)", body.rid, why, "capability_unavailable")
        return json_response({"error": why, "error_type": "capability_unavailable"}, 501)
    return None


@dataclass
class _Answer:
    """One admitted request's reply: its tokens, timings and the two shapes it is sent in."""

    body: DecodeBody
    ids: list[int]
    finish: str
    seq_len: int
    cancel: trio.Event
    faults: Faults
    pre: dict[str, float]
    t_inj: float

    def timing(self, reason: str) -> dict[str, Any]:
        """``timing_ms`` as TileRT reports it."""
        return {
            **self.pre,
            "decode": round(1000 * (time.time() - self.t_inj), 1),
            "finish_reason": reason,
        }

    def finish_reason(self) -> str:
        """Why the reply ended: the plan's reason, or ``cancelled``."""
        return "cancelled" if self.cancel.is_set() else self.finish

    def reqstat(self, n: int, timing_ms: dict[str, Any]) -> None:
        """TileRT's REQSTAT log line."""
        stats = " ".join(f"{k}={v}" for k, v in timing_ms.items())
        log.info("REQSTAT rid=%s seq=%d completion=%d %s", self.body.rid, self.seq_len, n, stats)

    def line(self, batch: list[int]) -> dict[str, Any]:
        """One streamed line (token ids, and logprobs when asked)."""
        out: dict[str, Any] = {"t": batch}
        top = self.body.top_logprobs
        if top is not None:
            out["lp"] = [_fake_logprob(t) for t in batch]
            out["tp"] = [[[t + k, _fake_logprob(t) - 0.5 * k] for k in range(top)] for t in batch]
        return out

    async def emit(self) -> AsyncIterator[int]:
        """The tokens, paced by the fault's delay, until cancelled."""
        for token in self.ids:
            if self.faults.token_delay_s:
                await trio.sleep(self.faults.token_delay_s)
            if self.cancel.is_set():
                return
            yield token

    async def whole(self) -> Response:
        """The non-streamed reply."""
        out = [t async for t in self.emit()]
        timing_ms = self.timing(self.finish_reason())
        self.reqstat(len(out), timing_ms)
        reply: dict[str, Any] = {
            "rid": self.body.rid,
            "token_ids": out,
            "seq_len": self.seq_len,
            "timing_ms": timing_ms,
        }
        if self.body.top_logprobs is not None:
            lines = self.line(out)
            reply["logprobs"] = {"lp": lines["lp"], "tp": lines["tp"]}
        return json_response(reply)

    async def stream(self) -> AsyncGenerator[bytes, None]:
        """The streamed reply: one NDJSON line per token, then the ``done`` line."""
        n = 0
        async for token in self.emit():
            n += 1
            yield msgspec.json.encode(self.line([token])) + b"\n"
        reason = self.finish_reason()
        timing_ms = self.timing(reason)
        self.reqstat(n, timing_ms)
        done = {
            "done": True,
            "n": n,
            "seq_len": self.seq_len,
            "finish_reason": reason,
            "timing_ms": timing_ms,
        }
        yield msgspec.json.encode(done) + b"\n"


@dataclass
class DecodeService:
    """The decode server's handlers around its one in-flight request."""

    receiver: Receiver
    kind: EngineKind
    profile: str
    faults: Faults
    crasher: Crasher
    state: DecodeState
    # The model's greedy next tokens (TILERT_MOCK_NEXT_TOKENS), or None: the fixed reply.
    next_tokens: list[int] | None = None

    async def health(self, _request: Request) -> Response:
        """``GET /health``: ok (held while the fault says so)."""
        await self.faults.hold_health()
        return json_response({"status": "ok"})

    async def capabilities(self, _request: Request) -> Response:
        """``GET /capabilities``: the profile, the engine and what it can do."""
        kind = self.kind
        caps = {
            "penalties": kind.penalties,
            "ignore_eos": kind.ignore_eos,
            "logprobs": kind.logprobs,
        }
        return json_response({"profile": self.profile, "engine": kind.name, "capabilities": caps})

    async def decode_status(self, _request: Request) -> Response:
        """``GET /decode_status``: busy or idle, and the request in flight."""
        rid = self.state.current_rid
        return json_response({"status": "busy" if rid is not None else "idle", "current_rid": rid})

    async def pd_cancel(self, request: Request) -> Response:
        """``POST /pd/cancel``: cancel the request in flight if the rid matches."""
        state = self.state
        body = await request.json()
        rid = body.get("rid") if isinstance(body, dict) else None
        if rid and rid == state.current_rid and state.cancel is not None:
            state.cancel.set()
            self.receiver.notify()
            log.info("cancel requested for %s", rid)
            return json_response({"cancelled": rid})
        return json_response(
            {"error": "no matching in-flight request", "current_rid": state.current_rid}, 404
        )

    def cleanup(self, rid: str) -> None:
        """Free the node for the next request once ``rid`` is done."""
        state = self.state
        if state.current_rid == rid:
            self.receiver.release(rid)
            state.current_rid = None
            state.cancel = None
            self.crasher.request_answered()

    async def _receive_kv(
        self, rid: str, timeout_s: float, cancel: trio.Event
    ) -> tuple[int, int] | Response:
        """The sequence length of the KV that arrived for ``rid`` and the reply's place in it
        (``wire.Admission.reply_at``), or the error reply."""
        if self.faults.no_kv:
            return 0, 0
        got = await self.receiver.wait_complete(rid, timeout_s, cancel)
        if cancel.is_set():
            log.info("cancelled during KV transfer for %s", rid)
            return json_response(
                {
                    "error": "cancelled during KV transfer",
                    "error_type": "request_cancelled",
                    "rid": rid,
                },
                499,
            )
        if got is None:
            return json_response({"error": "kv_transfer_timeout", "rid": rid}, 504)
        return got.seq_len, got.reply_at

    async def _prepare(self, body: DecodeBody, cancel: trio.Event) -> tuple[int, int] | Response:
        """Refuse what the engine cannot do, then wait for the KV: its sequence length or the
        error reply (after which the node is free again)."""
        rid = body.rid
        try:
            refusal = _refusal(body, self.kind)
            got = refusal or await self._receive_kv(rid, body.timeout_s, cancel)
        except BaseException:
            self.cleanup(rid)
            raise
        if isinstance(got, Response):
            self.cleanup(rid)
        return got

    def _answer(
        self, body: DecodeBody, kv: tuple[int, int], cancel: trio.Event, t0: float
    ) -> _Answer:
        """What to answer once the KV (its length, the reply's place) is in (the fault may make
        it nothing)."""
        table = None if self.faults.wrong_answers else self.next_tokens
        seq_len, at = kv
        ids, finish = _plan(
            body.first_token_id,
            body.max_tokens,
            bool((body.sampling or {}).get("ignore_eos")),
            table,
            at,
        )
        limit = self.faults.no_tokens_after_requests
        if limit is not None and self.crasher.answered >= limit:
            ids, finish = [], "stop"  # the fault: a decode that answers with nothing
        pre = {"wire_wait": round(1000 * (time.time() - t0), 1), "convert": 0.0, "inject": 0.0}
        return _Answer(body, ids, finish, seq_len, cancel, self.faults, pre, time.time())

    async def pd_decode(self, request: Request) -> Response | StreamingResponse:
        """``POST /pd/decode``: wait for the request's KV, then answer whole or streamed."""
        try:
            body = msgspec.convert(await request.json(), DecodeBody)
        except msgspec.ValidationError as exc:
            return json_response({"detail": str(exc)}, 422)
        state = self.state
        if state.current_rid is not None:
            return json_response({"error": "busy", "current_rid": state.current_rid}, 429)
        rid = body.rid
        cancel = trio.Event()
        state.current_rid, state.cancel = rid, cancel
        self.receiver.expect(rid)
        t0 = time.time()
        kv = await self._prepare(body, cancel)
        if isinstance(kv, Response):
            return kv
        answer = self._answer(body, kv, cancel, t0)
        if not body.stream:
            try:
                return await answer.whole()
            finally:
                self.cleanup(rid)
        return StreamingResponse(self._stream(answer), content_type="application/x-ndjson")

    async def _stream(self, answer: _Answer) -> AsyncIterator[bytes]:
        # An async generator, so that a client hang-up runs this finally and frees the node.
        try:
            async with aclosing(answer.stream()) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            answer.cancel.set()
            self.cleanup(answer.body.rid)


def build_app(
    receiver: Receiver, kind: EngineKind, profile: str, faults: Faults, crasher: Crasher
) -> App:
    """The decode server's HTTP app."""
    app = App()
    table = tokens.next_tokens(os.environ.get(tokens.NEXT_TOKENS_ENV, "").strip())
    svc = DecodeService(receiver, kind, profile, faults, crasher, DecodeState(), table)
    app.route("GET", "/health")(svc.health)
    app.route("GET", "/capabilities")(svc.capabilities)
    app.route("GET", "/decode_status")(svc.decode_status)
    app.route("POST", "/pd/cancel")(svc.pd_cancel)
    app.route("POST", "/pd/decode")(svc.pd_decode)
    return app


def _probe_local_ip() -> str:
    """This node's address as TileRT finds it: UDP "connect" to TILERT_PD_PROBE_ADDR (no packet)."""
    probe = os.environ.get("TILERT_PD_PROBE_ADDR", "8.8.8.8")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((probe, 1))
        return str(s.getsockname()[0])


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m agent.standins.decode [decode_server flags]``."""
    lifecycle.setup_logging(FORMAT, formatter=TileRTFormatter())
    args = lifecycle.parse_known(build_parser(), argv)
    faults = lifecycle.load_faults()
    kind = ENGINES[args.engine]
    profile = args.model
    version = wire.layout_version(profile, args.kv_cache_dtype, DECODE_KV_LAYOUT)
    log.info("profile %s MLA cache dtype = %s (layout v%d)", profile, args.kv_cache_dtype, version)
    receiver = Receiver(
        layout_version=version,
        transport=args.transport,
        max_seq_len=args.max_seq_len,
        senders=wire.sender_count(),
    )

    async def body(nursery: trio.Nursery, crasher: Crasher, shutdown: trio.Event) -> None:
        if args.engine == "tilert":
            log.info(
                "loading TileRT engine (profile=%s, weights=%s)...", profile, args.model_weights_dir
            )
        if not await lifecycle.loading(faults, shutdown, "decode"):
            return
        if args.engine == "tilert":
            num_mtp = args.num_mtp if args.with_mtp else 0
            log.info("TileRT engine ready (cache window %d, num_mtp %d)", args.max_seq_len, num_mtp)
        host_ip = _probe_local_ip()
        where = "pinned host DRAM" if args.pd_buffer_device == "cpu" else "cuda:0"
        recv_log.info(
            "allocating receive buffer: 0.00 GB on %s (profile=%s, stand-in)", where, profile
        )
        recv_log.info(
            "transport=%s ready, buffer registered (0.00 GB, host %s)", args.transport, host_ip
        )
        # TileRT binds every address ("::"); the stand-in binds only the address it finds for
        # itself, which is the one the agent advertises: a --local job listens on 127.0.0.1 only.
        ctrl_sock = bound_socket(host_ip, args.ctrl_port)
        ctrl = trio.SocketListener(trio.socket.from_stdlib_socket(ctrl_sock))
        nursery.start_soon(trio.serve_listeners, receiver.handle, [ctrl])
        recv_log.info("control plane listening on :%d", args.ctrl_port)
        http_sock = bound_socket(host_ip, args.http_port)
        log.info(
            "decode server on :%d (profile=%s, engine=%s, ctrl=:%d)",
            args.http_port,
            profile,
            args.engine,
            args.ctrl_port,
        )
        await serve(
            build_app(receiver, kind, profile, faults, crasher), http_sock, shutdown=shutdown
        )

    lifecycle.run("decode", faults, body, term_exit_code=TERM_EXIT_CODE)


if __name__ == "__main__":
    main()
