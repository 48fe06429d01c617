"""Fault switches for the stand-in engines, read from the environment at startup.

Every switch is off when unset or empty:

- ``TILERT_MOCK_STARTUP_DELAY_S``: seconds to "load" before binding any port; meanwhile the ports
  are free and ``/health`` refuses connections (as vLLM and TileRT do while loading).
- ``TILERT_MOCK_CRASH_AFTER_REQUESTS=N``: die right after the N-th request has been answered.
- ``TILERT_MOCK_CRASH_AFTER_S=S``: die S seconds after the process started.
- ``TILERT_MOCK_EXIT_CODE``: the exit code of those deaths (default 1, with an error on stderr).
  ``0`` exits 0 after an ``EngineDeadError`` line, as vLLM's API process does when its engine dies.
- ``TILERT_MOCK_HANG_HEALTH=1``: ``/health`` accepts the connection and never answers.
- ``TILERT_MOCK_NO_KV=1``: the prefill never sends KV (no ctrl-port handshake); the decode never
  waits for it (decodes at once).
- ``TILERT_MOCK_TOKEN_DELAY_S``: the decode sleeps this long before each token (so latencies
  in a benchmark are not trivial: 0.01 gives an inter-token latency of about 10 ms).
- ``TILERT_MOCK_NO_TOKENS_AFTER_REQUESTS=N``: once N requests were answered, the decode answers
  every request with no token at all (as TileRT does when the first token is a stop token): a
  job that turns ready, then "serves" nothing; a benchmark must fail on it.
- ``TILERT_MOCK_NEXT_TOKENS=PATH``: not a fault (the fault target does not apply; read by the
  decode, ``agent.standins.tokens``): a model's greedy next token per last token
  (``{"next": [id, ...]}``, written by tests/infra/vllm_env.py for a model whose next token
  depends on the last one only): the decode continues the first token by it, as a decode with
  the prefill's weights and a compatible KV would. Unset: a fixed reply.
- ``TILERT_MOCK_WRONG_ANSWERS=1``: the decode ignores ``TILERT_MOCK_NEXT_TOKENS`` and answers
  its fixed reply, whatever the prompt: fluent tokens that do not follow from the KV, as a
  decode reading a mismatched KV layout would.
- ``TILERT_MOCK_METRICS_FILE``: the prefill's ``/metrics`` serves this file verbatim (re-read on
  every scrape, 500 while it is missing) instead of its live registry.
- ``TILERT_MOCK_PROGRESS_EVERY_S=S``: while "loading" (``TILERT_MOCK_STARTUP_DELAY_S``), print a
  progress bar line every S seconds (vLLM's ``Loading safetensors checkpoint shards``, redrawn
  with a carriage return as tqdm does), so the agent's startup deadline sees progress.
- ``TILERT_MOCK_FAILURE=NAME``: print the real message of failure signature NAME
  (``agent.standins.failmodes``) in the program whose log shows it; a startup failure then exits.
- ``TILERT_MOCK_FAULT_TARGET=NAME``: every switch above applies only to the engine whose
  ``TILERT_AGENT_NAME`` (set by the agent: ``prefill-0``, ``decode-1``, ...) equals NAME, so one
  decode of a job can be made to crash-loop while the others serve.
- ``TILERT_MOCK_FAULT_STARTS=N`` with ``TILERT_MOCK_FAULT_STARTS_FILE=PATH``: the switches apply
  to the first N starts of the engine only (counted in PATH, across restarts and agents); later
  starts run clean: a decode that crash-loops, then heals.

The weight converter stand-in (``agent.standins.converter``) has switches of its own
(``ConvertFaults``; the fault target applies to them too):

- ``TILERT_MOCK_CONVERT_SHARDS=N`` (default 4) and ``TILERT_MOCK_CONVERT_SHARD_BYTES=B``
  (default 65536): how much it writes.
- ``TILERT_MOCK_CONVERT_DELAY_S=S``: it sleeps S seconds before each shard (a slow conversion).
- ``TILERT_MOCK_CONVERT_CRASH_AFTER_SHARDS=N``: it dies half way, right after the N-th shard, with
  ``TILERT_MOCK_EXIT_CODE`` (default 1) and an error on stderr.
- ``TILERT_MOCK_CONVERT_DISK_BYTES=B``: its ``--save_dir`` sits on a "disk" of B bytes: a write
  past that fails with ENOSPC (``OSError: [Errno 28] No space left on device``), as on a full disk.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import trio

from agent.errors import BadInput
from agent.standins.failmodes import MODES

log = logging.getLogger("standin.faults")

PREFIX = "TILERT_MOCK_"
TARGET_ENV = "TILERT_MOCK_FAULT_TARGET"
AGENT_NAME_ENV = "TILERT_AGENT_NAME"
# How long a dying stand-in lets the answer that triggered its death reach the client.
_CRASH_FLUSH_S = 0.1


class FaultConfigError(BadInput, ValueError):
    """A TILERT_MOCK_* value that cannot be parsed."""


@dataclass(frozen=True)
class Faults:
    startup_delay_s: float = 0.0
    crash_after_requests: int | None = None
    crash_after_s: float | None = None
    exit_code: int = 1
    hang_health: bool = False
    no_kv: bool = False
    token_delay_s: float = 0.0
    no_tokens_after_requests: int | None = None
    metrics_file: Path | None = None
    progress_every_s: float | None = None
    failure: str | None = None
    wrong_answers: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Faults:
        """The switches in ``env`` (default: this process's), honouring the fault target."""
        env = os.environ if env is None else env
        target = env.get(TARGET_ENV, "").strip()
        if target and target != env.get(AGENT_NAME_ENV, "").strip():
            return cls()
        if not _faulty_start(env):
            return cls()  # healed: past its faulty starts
        metrics = _text(env, "METRICS_FILE")
        failure = _text(env, "FAILURE") or None
        if failure is not None and failure not in MODES:
            raise FaultConfigError(
                f"{PREFIX}FAILURE={failure!r} names no known failure; one of: {', '.join(MODES)}"
            )
        return cls(
            startup_delay_s=_number(env, "STARTUP_DELAY_S") or 0.0,
            crash_after_requests=_integer(env, "CRASH_AFTER_REQUESTS"),
            crash_after_s=_number(env, "CRASH_AFTER_S"),
            exit_code=_integer(env, "EXIT_CODE") if _text(env, "EXIT_CODE") else 1,  # type: ignore[arg-type]
            hang_health=_flag(env, "HANG_HEALTH"),
            no_kv=_flag(env, "NO_KV"),
            token_delay_s=_number(env, "TOKEN_DELAY_S") or 0.0,
            no_tokens_after_requests=_integer(env, "NO_TOKENS_AFTER_REQUESTS"),
            metrics_file=Path(metrics) if metrics else None,
            progress_every_s=_number(env, "PROGRESS_EVERY_S") or None,
            failure=failure,
            wrong_answers=_flag(env, "WRONG_ANSWERS"),
        )

    async def hold_health(self) -> None:
        """Under ``TILERT_MOCK_HANG_HEALTH``, never return: ``/health`` accepts and hangs."""
        if self.hang_health:
            await trio.sleep_forever()

    def describe(self) -> str:
        """The active switches, for the startup log."""
        default = Faults()
        changed = [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]
        return ", ".join(changed) or "none"


class Crasher:
    """Carries out the crash switches: after N answered requests, or S seconds after start."""

    def __init__(self, faults: Faults, name: str) -> None:
        self.faults = faults
        self.name = name
        self.answered = 0
        self._due = trio.Event()

    def request_answered(self) -> None:
        """Count one answered request; the N-th schedules the crash."""
        self.answered += 1
        limit = self.faults.crash_after_requests
        if limit is not None and self.answered >= limit:
            self._due.set()

    async def run(self) -> None:
        """Wait for a crash condition, then die (run it in the engine's nursery)."""
        if self.faults.crash_after_s is not None:
            with trio.move_on_after(self.faults.crash_after_s):
                await self._due.wait()
            reason = (
                f"{self.answered} request(s) answered"
                if self._due.is_set()
                else (f"{self.faults.crash_after_s}s since start")
            )
        else:
            await self._due.wait()
            reason = f"{self.answered} request(s) answered"
        await trio.sleep(_CRASH_FLUSH_S)
        die(self.name, reason, self.faults.exit_code)


def die(name: str, reason: str, code: int) -> None:
    """Exit now with ``code``, saying why on stderr the way the real engine would."""
    if code == 0:
        log.error("EngineCore encountered a fatal error (%s stand-in fault: %s)", name, reason)
        log.error("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.")
    else:
        log.critical("%s stand-in fault: crashing after %s (exit %d)", name, reason, code)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


def _faulty_start(env: Mapping[str, str]) -> bool:
    """Whether this start of the engine gets the switches: always, unless
    ``TILERT_MOCK_FAULT_STARTS=N`` limits them to the first N starts, counted in
    ``TILERT_MOCK_FAULT_STARTS_FILE`` (one byte appended per start; it outlives the agent, so a
    restarted agent's engine counts on)."""
    starts = _integer(env, "FAULT_STARTS")
    if starts is None:
        return True
    path = _text(env, "FAULT_STARTS_FILE")
    if not path:
        raise FaultConfigError(f"{PREFIX}FAULT_STARTS needs {PREFIX}FAULT_STARTS_FILE (a path)")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b".")
            this_start = os.fstat(fd).st_size
        finally:
            os.close(fd)
    except OSError as exc:
        raise FaultConfigError(f"{PREFIX}FAULT_STARTS_FILE={path!r}: {exc.strerror}") from None
    return this_start <= starts


def _text(env: Mapping[str, str], key: str) -> str:
    return env.get(PREFIX + key, "").strip()


def _number(env: Mapping[str, str], key: str) -> float | None:
    raw = _text(env, key)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise FaultConfigError(f"{PREFIX}{key}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise FaultConfigError(f"{PREFIX}{key}={raw!r} must not be negative")
    return value


def _integer(env: Mapping[str, str], key: str) -> int | None:
    raw = _text(env, key)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise FaultConfigError(f"{PREFIX}{key}={raw!r} is not an integer") from None


def _flag(env: Mapping[str, str], key: str) -> bool:
    return _text(env, key).lower() not in ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class ConvertFaults:
    """The weight converter stand-in's switches (``TILERT_MOCK_CONVERT_*``, module docstring)."""

    shards: int = 4
    shard_bytes: int = 64 * 1024
    delay_s: float = 0.0
    crash_after_shards: int | None = None
    disk_bytes: int | None = None
    exit_code: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ConvertFaults:
        """The switches in ``env`` (default: this process's), honouring the fault target."""
        env = os.environ if env is None else env
        default = cls()
        # How much is written is not a fault: it applies whatever the target.
        shards = _integer(env, "CONVERT_SHARDS")
        size = _integer(env, "CONVERT_SHARD_BYTES")
        sized = cls(
            shards=default.shards if shards is None else shards,
            shard_bytes=default.shard_bytes if size is None else size,
        )
        if sized.shards < 1 or sized.shard_bytes < 1:
            raise FaultConfigError(
                f"{PREFIX}CONVERT_SHARDS and {PREFIX}CONVERT_SHARD_BYTES must be at least 1"
            )
        target = env.get(TARGET_ENV, "").strip()
        if target and target != env.get(AGENT_NAME_ENV, "").strip():
            return sized
        return cls(
            shards=sized.shards,
            shard_bytes=sized.shard_bytes,
            delay_s=_number(env, "CONVERT_DELAY_S") or 0.0,
            crash_after_shards=_integer(env, "CONVERT_CRASH_AFTER_SHARDS"),
            disk_bytes=_integer(env, "CONVERT_DISK_BYTES"),
            exit_code=_integer(env, "EXIT_CODE") if _text(env, "EXIT_CODE") else 1,  # type: ignore[arg-type]
        )
