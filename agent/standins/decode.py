"""Stand-in for TileRT's decode server (``python -m tilert.pd_vllm.decode_server``).

Same flags, same HTTP app (``/health``, ``/capabilities``, ``/decode_status``, ``POST /pd/decode``,
``POST /pd/cancel``), same control plane on the ctrl port (``agent.standins.wire``), both bound on
``('::', port)`` dual-stack, same startup lines and exit codes (SIGTERM 143, startup error 1). The
"engine" answers ``[first_token_id]`` + a short fixed reply in the demo tokenizer's byte ids
(``agent.standins.tokens``), ending with EOS, cut at ``max_tokens``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from agent.http.asgi import (
    App,
    Request,
    Response,
    StreamingResponse,
    bound_socket,
    json_response,
    serve,
)
from agent.standins import lifecycle, tokens, wire
from agent.standins.faults import Crasher, Faults

log = logging.getLogger("pd_vllm.decode_server")
recv_log = logging.getLogger("pd_vllm.receive")

TERM_EXIT_CODE = 143
# ReceiveServer's request_timeout: a slot older than this is reclaimed, a tombstone lasts this long.
REQUEST_TIMEOUT_S = 120.0
# How long a decode stream may go without a token before it reports a stall (as TileRT does).
STALL_S = 600.0

FREE, RESERVED, TRANSFERRING, COMPLETE, CANCELLING = (
    "free",
    "reserved",
    "transferring",
    "complete",
    "cancelling",
)


def build_parser() -> argparse.ArgumentParser:
    """TileRT decode_server's flags, with its defaults and choices."""
    ap = argparse.ArgumentParser(prog="decode_server", allow_abbrev=False)
    ap.add_argument("--engine", choices=["stub", "tilert"], default="stub")
    ap.add_argument("--model", default="glm5", help="model profile")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--ctrl-port", type=int, default=wire.DEFAULT_CTRL_PORT)
    ap.add_argument("--http-port", type=int, default=5557)
    ap.add_argument("--model-weights-dir", default="")
    ap.add_argument("--with-mtp", action="store_true")
    ap.add_argument("--num-mtp", type=int, choices=(3,), default=3)
    ap.add_argument("--transport", choices=["mooncake", "nixl"], default=wire.DEFAULT_TRANSPORT)
    ap.add_argument("--kv-cache-dtype", default="fp8_ds_mla")
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
class Slot:
    """The one receive slot: a request whose KV is arriving (TileRT's ReceivedRequest)."""

    rid: str
    seq_len: int
    generation: int
    state: str = RESERVED
    done_ranks: set[int] = field(default_factory=set)
    writers: int = 0
    t_first: float = field(default_factory=time.time)


_CANCELLED = object()


class Receiver:
    """The decode side of the control plane (TileRT's ReceiveServer, minus the RDMA buffer)."""

    def __init__(
        self, *, layout_version: int, transport: str, max_seq_len: int, senders: int
    ) -> None:
        self.layout_version = layout_version
        self.transport = transport
        self.max_seq_len = max_seq_len
        self.senders = senders
        self.current: Slot | None = None
        self.completed: dict[str, Slot] = {}
        self.tombstones: dict[str, float] = {}
        self._generation = 0
        self._changed = trio.Event()

    def _reusable(self, cur: Slot) -> bool:
        if cur.state == COMPLETE:
            return True
        if cur.writers > 0:
            return False
        if cur.state in (FREE, CANCELLING):
            return True
        return time.time() - cur.t_first >= REQUEST_TIMEOUT_S

    def hello(self) -> wire.Hello:
        """The hello frame for a new connection."""
        busy = self.current is not None and not self._reusable(self.current)
        return wire.Hello(
            magic=wire.MAGIC,
            protocol_version=wire.PROTOCOL_VERSION,
            layout_version=self.layout_version,
            transport=self.transport,
            max_seq_len=self.max_seq_len,
            busy=busy,
            senders=self.senders,
            session_id=f"standin-{os.getpid()}",
        )

    def _tombstoned(self, rid: str) -> bool:
        deadline = self.tombstones.get(rid)
        if deadline is None:
            return False
        if deadline <= time.time():
            del self.tombstones[rid]
            return False
        return True

    def admit(self, req: wire.Admission) -> wire.Verdict:
        """Admit one sender rank, or say why not."""
        rid, rank = req.rid, req.rank
        if req.seq_len > self.max_seq_len:
            return wire.Verdict(
                accepted=False,
                rid=rid,
                error="seq_len exceeds max_seq_len",
                max_seq_len=self.max_seq_len,
            )
        if self._tombstoned(rid):
            if req.admission_window_s > 0:
                self.tombstones[rid] = max(
                    self.tombstones[rid], time.time() + req.admission_window_s
                )
            recv_log.warning(
                "refusing %s rank %d for now: no consumer is waiting for this request", rid, rank
            )
            return wire.Verdict(accepted=False, rid=rid, error="cancelling")
        cur = self.current
        if cur is not None and cur.rid == rid:
            if cur.state == CANCELLING:
                return wire.Verdict(accepted=False, rid=rid, error="cancelling")
            if rank in cur.done_ranks:
                return wire.Verdict(accepted=False, rid=rid, rank=rank, error="duplicate_rank")
        elif cur is not None and not self._reusable(cur):
            recv_log.warning(
                "rejecting %s rank %d (busy with %s, state=%s)", rid, rank, cur.rid, cur.state
            )
            return wire.Verdict(accepted=False, error="busy", busy_rid=cur.rid)
        else:
            self._generation += 1
            cur = self.current = Slot(rid=rid, seq_len=req.seq_len, generation=self._generation)
            recv_log.info(
                "request %s: seq_len=%d (generation %d)", rid, cur.seq_len, cur.generation
            )
        cur.state = TRANSFERRING
        cur.writers += 1
        return wire.Verdict(accepted=True, rid=rid, rank=rank, generation=cur.generation)

    def done(self, rid: str, rank: int, generation: int) -> None:
        """A rank finished writing; the last one completes the request."""
        cur = self.current
        if cur is None or cur.rid != rid or cur.generation != generation:
            recv_log.warning("ignoring done from %s rank %d: the slot has moved on", rid, rank)
            return
        if cur.state == CANCELLING:
            recv_log.warning("ignoring done from %s rank %d: request was abandoned", rid, rank)
            return
        cur.done_ranks.add(rank)
        recv_log.info(
            "request %s: rank %d done (%d/%d)", rid, rank, len(cur.done_ranks), self.senders
        )
        if cur.done_ranks >= set(range(self.senders)):
            cur.state = COMPLETE
            self.completed[rid] = cur
            recv_log.info(
                "request %s: all ranks done in %.1f ms", rid, 1000 * (time.time() - cur.t_first)
            )
            self.notify()

    def writer_left(self, rid: str, generation: int) -> None:
        """A sender connection closed."""
        cur = self.current
        if cur is None or cur.generation != generation:
            return
        cur.writers = max(0, cur.writers - 1)
        if cur.state == CANCELLING and cur.writers == 0:
            recv_log.info("request %s drained; receive slot free", cur.rid)
            self.current = None

    def notify(self) -> None:
        """Wake whoever waits for KV (a completion or a cancel)."""
        self._changed.set()
        self._changed = trio.Event()

    def expect(self, rid: str) -> None:
        """A decode request for ``rid`` is waiting: forget its tombstone."""
        self.tombstones.pop(rid, None)

    def release(self, rid: str) -> None:
        """The decode request for ``rid`` ended: free the slot, refuse late senders for a while."""
        now = time.time()
        self.tombstones = {r: t for r, t in self.tombstones.items() if t > now}
        self.tombstones[rid] = now + REQUEST_TIMEOUT_S
        self.completed.pop(rid, None)
        cur = self.current
        if cur is None or cur.rid != rid:
            return
        if cur.writers > 0 and cur.state != COMPLETE:
            cur.state = CANCELLING
            return
        self.current = None

    async def wait_complete(self, rid: str, timeout_s: float, cancel: trio.Event) -> Any:
        """The completed slot for ``rid``, None on timeout, ``_CANCELLED`` when cancelled."""
        deadline = trio.current_time() + timeout_s
        while True:
            if cancel.is_set():
                return _CANCELLED
            for other in [r for r in self.completed if r != rid]:
                log.warning("dropping unmatched request %s (waiting for %s)", other, rid)
                self.release(other)
            if rid in self.completed:
                return self.completed.pop(rid)
            if trio.current_time() >= deadline:
                return None
            changed = self._changed
            with trio.move_on_at(deadline):
                await changed.wait()

    async def handle(self, stream: trio.SocketStream) -> None:
        """One sender connection: hello, admission, verdict, done."""
        frames = wire.FrameStream(stream)
        admitted: tuple[str, int] | None = None
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                await frames.send(self.hello())
                req = await frames.receive_as(wire.Admission)
                verdict = self.admit(req)
                await frames.send(verdict)
                if not verdict.accepted:
                    return
                assert verdict.generation is not None
                admitted = (req.rid, verdict.generation)
                msg = await frames.receive()
            if not msg.get("done"):
                recv_log.warning("rank %d sent non-done message: %s", req.rank, msg)
                return
            self.done(req.rid, req.rank, verdict.generation)
        except (wire.WireError, trio.BrokenResourceError, trio.TooSlowError) as exc:
            recv_log.warning("control connection failed: %s", exc)
        finally:
            if admitted is not None:
                self.writer_left(*admitted)
            await stream.aclose()


@dataclass
class DecodeState:
    """The one in-flight decode request (TileRT serves one at a time)."""

    current_rid: str | None = None
    cancel: trio.Event | None = None


def _plan(first_token_id: int, max_tokens: int, ignore_eos: bool) -> tuple[list[int], str]:
    """The tokens to emit and the finish reason."""
    tail = tokens.continuation_ids()
    if ignore_eos:
        tail = [t for t in tail if t != tokens.EOS_ID]
        ids = [first_token_id, *itertools.islice(itertools.cycle(tail), max(0, max_tokens - 1))]
        return ids[: max(1, max_tokens)], "length"
    ids = [first_token_id, *tail]
    if first_token_id == tokens.EOS_ID:
        return [first_token_id], "stop"
    if len(ids) > max_tokens:
        return ids[: max(1, max_tokens)], "length"
    return ids, "stop"


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


def build_app(
    receiver: Receiver, kind: EngineKind, profile: str, faults: Faults, crasher: Crasher
) -> App:
    """The decode server's HTTP app."""
    app = App()
    state = DecodeState()

    @app.route("GET", "/health")
    async def health(request: Request) -> Response:
        if faults.hang_health:
            await trio.sleep_forever()
        return json_response({"status": "ok"})

    @app.route("GET", "/capabilities")
    async def capabilities(request: Request) -> Response:
        caps = {
            "penalties": kind.penalties,
            "ignore_eos": kind.ignore_eos,
            "logprobs": kind.logprobs,
        }
        return json_response({"profile": profile, "engine": kind.name, "capabilities": caps})

    @app.route("GET", "/decode_status")
    async def decode_status(request: Request) -> Response:
        busy = state.current_rid is not None
        return json_response(
            {"status": "busy" if busy else "idle", "current_rid": state.current_rid}
        )

    @app.route("POST", "/pd/cancel")
    async def pd_cancel(request: Request) -> Response:
        body = await request.json()
        rid = body.get("rid") if isinstance(body, dict) else None
        if rid and rid == state.current_rid and state.cancel is not None:
            state.cancel.set()
            receiver.notify()
            log.info("cancel requested for %s", rid)
            return json_response({"cancelled": rid})
        return json_response(
            {"error": "no matching in-flight request", "current_rid": state.current_rid}, 404
        )

    def cleanup(rid: str) -> None:
        if state.current_rid == rid:
            receiver.release(rid)
            state.current_rid = None
            state.cancel = None
            crasher.request_answered()

    @app.route("POST", "/pd/decode")
    async def pd_decode(request: Request) -> Response | StreamingResponse:
        try:
            body = msgspec.convert(await request.json(), DecodeBody)
        except msgspec.ValidationError as exc:
            return json_response({"detail": str(exc)}, 422)
        if state.current_rid is not None:
            return json_response({"error": "busy", "current_rid": state.current_rid}, 429)
        rid = body.rid
        cancel = trio.Event()
        state.current_rid, state.cancel = rid, cancel
        receiver.expect(rid)
        t0 = time.time()
        try:
            if body.top_logprobs is not None and not kind.logprobs:
                log.info("logprobs requested but unsupported by %s (rid=%s)", kind.name, rid)
                cleanup(rid)
                return json_response(
                    {
                        "error": f"{kind.name} does not produce logprobs",
                        "error_type": "logprobs_unavailable",
                    },
                    501,
                )
            why = _unsupported(body.sampling or {}, kind)
            if why is not None:
                log.info("sampling rejected for %s: %s", rid, why)
                cleanup(rid)
                return json_response({"error": why, "error_type": "capability_unavailable"}, 501)
            seq_len = 0
            if not faults.no_kv:
                got = await receiver.wait_complete(rid, body.timeout_s, cancel)
                if got is _CANCELLED:
                    log.info("cancelled during KV transfer for %s", rid)
                    cleanup(rid)
                    return json_response(
                        {
                            "error": "cancelled during KV transfer",
                            "error_type": "request_cancelled",
                            "rid": rid,
                        },
                        499,
                    )
                if got is None:
                    cleanup(rid)
                    return json_response({"error": "kv_transfer_timeout", "rid": rid}, 504)
                seq_len = got.seq_len
        except BaseException:
            cleanup(rid)
            raise
        ids, finish = _plan(
            body.first_token_id, body.max_tokens, bool((body.sampling or {}).get("ignore_eos"))
        )
        pre = {"wire_wait": round(1000 * (time.time() - t0), 1), "convert": 0.0, "inject": 0.0}
        t_inj = time.time()

        def timing(reason: str) -> dict[str, Any]:
            return {
                **pre,
                "decode": round(1000 * (time.time() - t_inj), 1),
                "finish_reason": reason,
            }

        def reqstat(n: int, timing_ms: dict[str, Any]) -> None:
            stats = " ".join(f"{k}={v}" for k, v in timing_ms.items())
            log.info("REQSTAT rid=%s seq=%d completion=%d %s", rid, seq_len, n, stats)

        def line(batch: list[int]) -> dict[str, Any]:
            out: dict[str, Any] = {"t": batch}
            if body.top_logprobs is not None:
                out["lp"] = [_fake_logprob(t) for t in batch]
                out["tp"] = [
                    [[t + k, _fake_logprob(t) - 0.5 * k] for k in range(body.top_logprobs)]
                    for t in batch
                ]
            return out

        async def emit() -> AsyncIterator[int]:
            for token in ids:
                if faults.token_delay_s:
                    await trio.sleep(faults.token_delay_s)
                if cancel.is_set():
                    return
                yield token

        if not body.stream:
            try:
                out = [t async for t in emit()]
                reason = "cancelled" if cancel.is_set() else finish
                timing_ms = timing(reason)
                reqstat(len(out), timing_ms)
                reply: dict[str, Any] = {
                    "rid": rid,
                    "token_ids": out,
                    "seq_len": seq_len,
                    "timing_ms": timing_ms,
                }
                if body.top_logprobs is not None:
                    lines = line(out)
                    reply["logprobs"] = {"lp": lines["lp"], "tp": lines["tp"]}
                return json_response(reply)
            finally:
                cleanup(rid)

        async def stream() -> AsyncIterator[bytes]:
            # An async generator, so that a client hang-up runs this finally and frees the node.
            n = 0
            try:
                async for token in emit():
                    n += 1
                    yield msgspec.json.encode(line([token])) + b"\n"
                reason = "cancelled" if cancel.is_set() else finish
                timing_ms = timing(reason)
                reqstat(n, timing_ms)
                done = {
                    "done": True,
                    "n": n,
                    "seq_len": seq_len,
                    "finish_reason": reason,
                    "timing_ms": timing_ms,
                }
                yield msgspec.json.encode(done) + b"\n"
            finally:
                cancel.set()
                cleanup(rid)

        return StreamingResponse(stream(), content_type="application/x-ndjson")

    return app


def _probe_local_ip() -> str:
    """This node's address as TileRT finds it: UDP "connect" to TILERT_PD_PROBE_ADDR (no packet)."""
    probe = os.environ.get("TILERT_PD_PROBE_ADDR", "8.8.8.8")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((probe, 1))
        return str(s.getsockname()[0])


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m agent.standins.decode [decode_server flags]``."""
    lifecycle.setup_logging("%(asctime)s %(name)s %(message)s")
    args = lifecycle.parse_known(build_parser(), argv)
    faults = lifecycle.load_faults()
    kind = ENGINES[args.engine]
    profile = args.model
    version = wire.layout_version(profile, args.kv_cache_dtype)
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
        if not await lifecycle.loading(faults, shutdown):
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
        ctrl_sock = bound_socket("::", args.ctrl_port)
        ctrl = trio.SocketListener(trio.socket.from_stdlib_socket(ctrl_sock))
        nursery.start_soon(trio.serve_listeners, receiver.handle, [ctrl])
        recv_log.info("control plane listening on :%d", args.ctrl_port)
        http_sock = bound_socket("::", args.http_port)
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
