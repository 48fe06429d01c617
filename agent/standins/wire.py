"""TileRT's decode control plane (ctrl port), as ``tilert.pd_vllm`` 0.1.6 speaks it.

One TCP connection per (request, sender rank); a frame is a 4-byte big-endian length and UTF-8
JSON (at most 16 MiB):

1. decode -> ``Hello`` (magic, protocol 2, layout version, transport, max_seq_len, busy, senders...)
2. prefill -> ``Admission`` (rid, rank, seq_len, last_prompt_token, sampling, admission_window_s)
3. decode -> ``Verdict`` (accepted + generation, or an error: "seq_len exceeds max_seq_len",
   "busy", "cancelling", "duplicate_rank"; the prefill retries busy/cancelling with 0.2 * 2^k s)
4. prefill writes the KV (RDMA in TileRT; nothing here), then ``Done`` and closes.

A request is complete when every sender rank said done. This module holds what both ends share
(frames, messages, the rid, the layout version, the sender count); ``agent.standins.kvlink`` holds
the two ends. Which dtype is which layout, and the transport default, are in ``agent.facts``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec
import trio

from agent.errors import RuntimeFailure
from agent.facts import DEFAULT_SENDERS

_T = TypeVar("_T")

MAGIC = "tilert-pd"
PROTOCOL_VERSION = 2
NUM_RANKS = 8
MAX_FRAME = 16 << 20
DEFAULT_CTRL_PORT = 5556
TRANSIENT_REJECTS = frozenset({"busy", "cancelling"})

# Model profile (agent.facts.TILERT_MODELS) -> base layout version (tilert.pd_vllm.profiles);
# offsets as in mla_nsa.py.
PROFILE_LAYOUT = {"glm5": 10, "dsv32": 11, "glm5_2": 12}
BF16_OFFSET, KI_TILED_OFFSET, ROCM_FP8_OFFSET, NO_MTP_OFFSET = 40, 100, 200, 1000
# KV layout family (the values of agent.facts' PREFILL_KV_LAYOUT and DECODE_KV_LAYOUT) -> offset.
LAYOUT_OFFSET = {"fp8 MLA": 0, "bf16": BF16_OFFSET, "ROCm fp8": ROCM_FP8_OFFSET}


class Hello(msgspec.Struct, omit_defaults=True):
    magic: str
    protocol_version: int
    layout_version: int
    transport: str
    max_seq_len: int
    busy: bool
    senders: int
    kv_base: int = 0
    pe_base: int = 0
    ki_base: int = 0
    session_id: str | None = None


class Admission(msgspec.Struct, omit_defaults=True):
    rid: str
    rank: int
    seq_len: int
    last_prompt_token: int = 0
    sampling: dict[str, Any] | None = None
    admission_window_s: float = 0.0
    prompt_token_ids: list[int] | None = None
    # The stand-ins' own, in place of the KV's content: how many tokens of the stand-in model's
    # reply the context already holds (a continued answer), so the decode continues from there.
    # Omitted when 0; TileRT's receiver reads only the keys it knows.
    reply_at: int = 0


class Verdict(msgspec.Struct, omit_defaults=True):
    accepted: bool
    rid: str | None = None
    rank: int | None = None
    generation: int | None = None
    error: str | None = None
    max_seq_len: int | None = None
    busy_rid: str | None = None


class Done(msgspec.Struct):
    done: bool
    rid: str
    rank: int
    generation: int


class WireError(RuntimeFailure):
    """The peer broke the protocol (closed mid-frame, oversized frame, wrong message)."""


def layout_version(profile: str, kv_cache_dtype: str, layouts: Mapping[str, str]) -> int:
    """The KV layout version of a profile and cache dtype; ValueError for unknown ones."""
    # ``layouts`` is the side's dtype -> layout table: vLLM reads "fp8" as the flat (ROCm) fp8
    # layout, TileRT's decode as fp8 MLA (agent.facts.PREFILL_KV_LAYOUT, DECODE_KV_LAYOUT).
    if profile not in PROFILE_LAYOUT:
        raise ValueError(f"unknown model profile {profile!r}; want one of {sorted(PROFILE_LAYOUT)}")
    layout = layouts.get((kv_cache_dtype or "").lower())
    if layout is None:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; want one of {', '.join(layouts)}"
        )
    version = PROFILE_LAYOUT[profile] + LAYOUT_OFFSET[layout]
    if profile == "glm5" and _env_flag("TILERT_PD_NO_MTP"):
        version += NO_MTP_OFFSET
    if _env_flag("TILERT_PD_KI_TILED"):
        version += KI_TILED_OFFSET
    return version


def sender_count() -> int:
    """TILERT_PD_SENDERS (default 8), clamped to 1..8 as TileRT does."""
    raw = (os.environ.get("TILERT_PD_SENDERS") or str(DEFAULT_SENDERS)).strip() or "1"
    return max(1, min(int(raw), NUM_RANKS))


def _env_flag(name: str) -> bool:
    return (os.environ.get(name) or "0").strip().lower() not in ("0", "false", "no", "off", "")


class FrameStream:
    """Frames over a trio stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._buffer = bytearray()

    async def send(self, message: msgspec.Struct) -> None:
        """Send one message: big-endian length + JSON."""
        data = msgspec.json.encode(message)
        await self.stream.send_all(struct.pack("!I", len(data)) + data)

    async def receive(self) -> dict[str, Any]:
        """The next message as a dict."""
        (length,) = struct.unpack("!I", await self._exactly(4))
        if length > MAX_FRAME:
            raise WireError(f"control message too large: {length}")
        try:
            message = msgspec.json.decode(await self._exactly(length))
        except msgspec.DecodeError as exc:
            raise WireError(f"control message is not JSON: {exc}") from None
        if not isinstance(message, dict):
            raise WireError(f"control message is not an object: {message!r}")
        return message

    async def receive_as(self, kind: type[_T]) -> _T:
        """The next message, validated as ``kind``."""
        try:
            return msgspec.convert(await self.receive(), kind)
        except msgspec.ValidationError as exc:
            raise WireError(f"bad {kind.__name__} message: {exc}") from None

    async def _exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise WireError("connection closed mid-message")
            self._buffer += chunk
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data
