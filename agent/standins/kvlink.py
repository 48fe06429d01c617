"""The two ends of TileRT's KV link control plane: the prefill's sender and the decode's receiver.

``Sender`` is TileRTConnector's sending side in the vLLM prefill (``kv_producer``): once a request
carrying ``kv_transfer_params`` is answered, every local sender rank opens its own connection to
the decode node's ctrl port, checks the hello against its own settings, asks for admission
(retrying busy/cancelling with backoff 0.2 * 2^k), and says done. ``Receiver`` is TileRT's
ReceiveServer in the decode: one receive slot, admitted ranks counted until all said done,
tombstones that refuse late senders of an abandoned request. The frames and messages they
exchange are in ``agent.standins.wire``; no KV moves (TileRT writes it over RDMA between admission
and done).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import trio

from agent.facts import (
    CONNECTOR,
    CONNECTOR_ROLE,
    DEFAULT_TILERT_MODEL,
    DEFAULT_TRANSPORT,
    PREFILL_KV_LAYOUT,
    derive_rid,
)
from agent.standins import tokens, wire

conn_log = logging.getLogger("pd_vllm.connector")
recv_log = logging.getLogger("pd_vllm.receive")
# TileRT logs a completed request nobody waits for from its decode server's wait loop.
consumer_log = logging.getLogger("pd_vllm.decode_server")

ADMISSION_ATTEMPTS = 5
ADMISSION_BACKOFF_S = 0.2
# How long one sender connection may take, hello to done.
SEND_TIMEOUT_S = 60
# ReceiveServer's request_timeout: a slot older than this is reclaimed, a tombstone lasts this long.
REQUEST_TIMEOUT_S = 120.0

# What one sender connection came to: "transient" refusals are retried.
Outcome = Literal["sent", "transient", "permanent"]


# --- the prefill's end ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectorConfig:
    """TileRTConnector's settings (``kv_connector_extra_config``) and its sender ranks."""

    host: str | None
    ctrl_port: int
    profile: str
    transport: str
    admission_attempts: int
    layout_version: int
    senders: int
    ranks: tuple[int, ...]
    tensor_parallel_size: int

    @classmethod
    def from_config(
        cls, config: dict[str, Any], *, tensor_parallel_size: int, kv_cache_dtype: str
    ) -> ConnectorConfig:
        """The connector as vLLM would build it from ``--kv-transfer-config``."""
        extra = config.get("kv_connector_extra_config") or {}
        profile = str(extra.get("tilert_model", DEFAULT_TILERT_MODEL))
        senders = wire.sender_count()
        tp = max(1, tensor_parallel_size)
        return cls(
            host=extra.get("tilert_host"),
            ctrl_port=int(extra.get("tilert_ctrl_port", wire.DEFAULT_CTRL_PORT)),
            profile=profile,
            transport=str(extra.get("tilert_transport", DEFAULT_TRANSPORT)),
            admission_attempts=int(extra.get("tilert_admission_attempts", ADMISSION_ATTEMPTS)),
            layout_version=wire.layout_version(profile, kv_cache_dtype, PREFILL_KV_LAYOUT),
            senders=senders,
            # Only ranks that exist send: a TP smaller than TILERT_PD_SENDERS leaves the decode
            # waiting for the missing ranks, exactly as with the real connector.
            ranks=tuple(r for r in range(senders) if r < tp),
            tensor_parallel_size=tensor_parallel_size,
        )

    def admission_window_s(self) -> float:
        """How long a refused rank keeps retrying (the decode extends its tombstone by it)."""
        return float(ADMISSION_BACKOFF_S * (2 ** max(0, self.admission_attempts - 1) - 1))

    def announce(self) -> None:
        """The connector's startup lines, with a warning for sender ranks that do not exist."""
        conn_log.info(
            "%s: role=%s profile=%s target=%s:%s",
            CONNECTOR,
            CONNECTOR_ROLE,
            self.profile,
            self.host,
            self.ctrl_port,
        )
        if len(self.ranks) < self.senders:
            conn_log.warning(
                "TILERT_PD_SENDERS=%d but --tensor-parallel-size=%d: ranks %d..%d do not exist, "
                "so every decode node will wait out its KV timeout",
                self.senders,
                self.tensor_parallel_size,
                len(self.ranks),
                self.senders - 1,
            )


@dataclass(frozen=True)
class Transfer:
    """One request's KV to hand over: to which decode node, how long, with which sampling."""

    rid: str
    host: str
    port: int
    seq_len: int
    sampling: dict[str, Any]
    reply_at: int = 0  # where the stand-in model's reply stands in the context (wire.Admission)


class Sender:
    """The connector's sending side: each claimed request is sent in the background."""

    def __init__(self, config: ConnectorConfig, nursery: trio.Nursery, *, no_kv: bool) -> None:
        self.config = config
        self.nursery = nursery
        # The TILERT_MOCK_NO_KV fault: claim requests but never send their KV.
        self.no_kv = no_kv

    def claim(
        self,
        request_id: str,
        params: dict[str, Any],
        seq_len: int,
        sampling: dict[str, Any],
        reply_at: int = 0,
    ) -> None:
        """Take a request whose ``kv_transfer_params`` name a decode node; send its KV soon
        (``reply_at``: how much of the stand-in model's reply its context holds)."""
        c = self.config
        rid = derive_rid(request_id)
        host = params["tilert_host"]
        conn_log.info(
            "claimed %s (rid=%s, %d tokens) -> %s:%s",
            request_id,
            rid,
            seq_len,
            host,
            params.get("tilert_ctrl_port", c.ctrl_port),
        )
        if self.no_kv:
            conn_log.warning("TILERT_MOCK_NO_KV: not sending the KV of %s", rid)
            return
        port = int(params.get("tilert_ctrl_port", c.ctrl_port))
        transfer = Transfer(rid, str(host), port, seq_len, sampling, reply_at)
        self.nursery.start_soon(self.send, transfer)

    async def send(self, transfer: Transfer) -> None:
        """Every local sender rank, in parallel, like the TP workers."""
        async with trio.open_nursery() as nursery:
            for rank in self.config.ranks:
                nursery.start_soon(self._send_rank, transfer, rank)

    async def _send_rank(self, transfer: Transfer, rank: int) -> None:
        """One rank: handshake (retrying transient refusals), "write", done."""
        rid = transfer.rid
        delay = ADMISSION_BACKOFF_S
        attempts = self.config.admission_attempts
        for attempt in range(1, attempts + 1):
            try:
                outcome = await self._handshake(transfer, rank)
            except (OSError, wire.WireError, trio.TooSlowError) as exc:
                conn_log.error("send failed for %s rank=%d: %s", rid, rank, exc)
                return
            if outcome != "transient" or attempt == attempts:
                if outcome == "transient":
                    conn_log.error(
                        "gave up admitting %s rank=%d after %d attempts: its shard was NOT "
                        "transferred, so the decode node will wait out its kv_transfer_timeout "
                        "for this request",
                        rid,
                        rank,
                        attempts,
                    )
                return
            conn_log.info(
                "retrying admission for %s rank=%d in %.1fs (attempt %d/%d)",
                rid,
                rank,
                delay,
                attempt,
                attempts,
            )
            await trio.sleep(delay)
            delay *= 2

    async def _handshake(self, transfer: Transfer, rank: int) -> Outcome:
        """One connection; WireError when the decode node does not match this connector."""
        rid, seq_len = transfer.rid, transfer.seq_len
        t0 = time.monotonic()
        with trio.fail_after(SEND_TIMEOUT_S):
            stream = await trio.open_tcp_stream(transfer.host, transfer.port)
            async with stream:
                frames = wire.FrameStream(stream)
                self._check_hello(await frames.receive(), seq_len)
                await frames.send(
                    wire.Admission(
                        rid=rid,
                        rank=rank,
                        seq_len=seq_len,
                        last_prompt_token=tokens.EOS_ID,
                        sampling=transfer.sampling or None,
                        admission_window_s=self.config.admission_window_s(),
                        reply_at=transfer.reply_at,
                    )
                )
                ack = await frames.receive()
                if not ack.get("accepted"):
                    conn_log.warning("decode node refused %s rank=%d: %s", rid, rank, ack)
                    return (
                        "transient" if ack.get("error") in wire.TRANSIENT_REJECTS else "permanent"
                    )
                generation = ack.get("generation")
                if (
                    ack.get("rid") != rid
                    or ack.get("rank") != rank
                    or not isinstance(generation, int)
                ):
                    conn_log.error(
                        "discarding %s rank=%d: admission does not match the request (%s)",
                        rid,
                        rank,
                        ack,
                    )
                    return "permanent"
                await frames.send(wire.Done(done=True, rid=rid, rank=rank, generation=generation))
                conn_log.info(
                    "sent %s: rank=%d seq=%d gen=%d 0.0 MB in %.1f ms",
                    rid,
                    rank,
                    seq_len,
                    generation,
                    1000 * (time.monotonic() - t0),
                )
                return "sent"

    def _check_hello(self, hello: dict[str, Any], seq_len: int) -> None:
        """TileRT's checks of the decode's hello (its messages too); WireError on a mismatch."""
        c = self.config
        if hello.get("magic") != wire.MAGIC:
            raise wire.WireError(f"bad hello: {hello}")
        # Read as a dict, not a wire.Hello: an older decode may lack fields, and says so here.
        remote = hello.get("protocol_version", 1)
        if remote != wire.PROTOCOL_VERSION:
            raise wire.WireError(
                f"control-plane protocol mismatch: decode={remote} vs "
                f"prefill={wire.PROTOCOL_VERSION}; upgrade both ends together"
            )
        if hello.get("layout_version") != c.layout_version:
            raise wire.WireError(
                f"layout version mismatch: {hello.get('layout_version')} vs {c.layout_version}"
            )
        try:
            senders = int(hello.get("senders", 1) or 1)
            max_seq_len = int(hello["max_seq_len"])
        except (KeyError, TypeError, ValueError):
            raise wire.WireError(f"bad hello: {hello}") from None
        if senders != c.senders:
            raise wire.WireError(
                f"sender-count mismatch: decode expects {senders} sender rank(s) but prefill has "
                f"{c.senders}; set TILERT_PD_SENDERS to the same value on both roles"
            )
        if hello.get("transport") != c.transport:
            raise wire.WireError(
                f"transport mismatch: decode={hello.get('transport')} vs prefill={c.transport}"
            )
        if seq_len > max_seq_len:
            raise wire.WireError(f"seq {seq_len} exceeds decode max_seq_len {max_seq_len}")


# --- the decode's end ----------------------------------------------------------------------------

FREE, RESERVED, TRANSFERRING, COMPLETE, CANCELLING = (
    "free",
    "reserved",
    "transferring",
    "complete",
    "cancelling",
)


@dataclass
class Slot:
    """The one receive slot: a request whose KV is arriving (TileRT's ReceivedRequest)."""

    rid: str
    seq_len: int
    generation: int
    state: str = RESERVED
    reply_at: int = 0  # the stand-in model's place in its reply (wire.Admission.reply_at)
    done_ranks: set[int] = field(default_factory=set)
    writers: int = 0
    t_first: float = field(default_factory=time.time)


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
            cur = self.current = Slot(
                rid=rid, seq_len=req.seq_len, generation=self._generation, reply_at=req.reply_at
            )
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

    def writer_left(self, _rid: str, generation: int) -> None:
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

    async def wait_complete(self, rid: str, timeout_s: float, cancel: trio.Event) -> Slot | None:
        """The completed slot for ``rid``; None on timeout or once ``cancel`` is set."""
        deadline = trio.current_time() + timeout_s
        while True:
            if cancel.is_set():
                return None
            for other in [r for r in self.completed if r != rid]:
                consumer_log.warning("dropping unmatched request %s (waiting for %s)", other, rid)
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
                if not verdict.accepted or verdict.generation is None:
                    return
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
