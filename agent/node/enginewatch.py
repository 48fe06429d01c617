"""What an engine's log says while it runs: startup progress and known failure signatures.

Fed by the log pump (``LogSink.watchers`` and, for progress bars redrawn with a carriage return,
``LogSink.partial_watchers``); read by the supervisor. While the engine starts, a line that shows
progress (weights, shards, compile, graph capture, buffers; docs/agent.md) is remembered with its
time: the supervisor extends the startup deadline by ``agent.startup_silence_s`` from it. A line
with a fatal signature (``agent.signatures``) ends the wait at once. Every signature seen is kept
(the last few) so the agent's ``reason`` can name a cause and a fix.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable

import trio

from agent.signatures import Finding, Where, best, for_role, match_block

# Progress lines while an engine loads. vLLM: its loader and compile/capture messages and
# tqdm bars (``Loading safetensors checkpoint shards:  34% Completed | 27/80 [...]``); TileRT's
# decode: its startup lines (pd_vllm/decode_server.py, receive_server.py); any tqdm bar
# (``| 27/80 [``).
PROGRESS = re.compile(
    rb"Loading safetensors checkpoint shards:.*|Loading weights took.*|Model loading took.*"
    rb"|Loading model.*|torch\.compile takes.*|Compiling a graph.*|Dynamo bytecode transform.*"
    rb"|Capturing CUDA graphs?.*|Graph capturing finished.*|init engine .*took.*"
    rb"|GPU KV cache size.*|Maximum concurrency for.*|Starting vLLM API server.*"
    rb"|loading TileRT engine.*|TileRT engine ready.*|allocating receive buffer.*"
    rb"|transport=\S+ ready.*|control plane listening.*|Recapturing CUDA graphs.*"
    rb"|\S[^\r\n|]*\|\s*\d+/\d+ \[.*",
)
_PROGRESS_NEEDLES = (
    b"Loading",
    b"took",
    b"ompil",
    b"Dynamo",
    b"apturing",
    b"KV cache size",
    b"Maximum concurrency",
    b"vLLM API server",
    b"TileRT engine",
    b"receive buffer",
    b"ready",
    b"listening",
    b"/",
)
PROGRESS_TEXT_CHARS = 120
PROGRESS_TAIL_BYTES = 8192
KEPT_FINDINGS = 20
# A healthy engine's reason shows a signature seen this recently (older ones were transient).
RECENT_S = 600.0


class EngineWatch:
    """One engine's log as the supervisor reads it: progress while starting, signatures always."""

    def __init__(self, where: Where, *, on_fatal: Callable[[], None] | None = None) -> None:
        self.signatures = for_role(where)
        self.on_fatal = on_fatal
        self.starting = True
        self.progress: str | None = None
        self.progress_at: float | None = None  # wall clock
        self.progress_trio: float | None = None  # trio clock: the supervisor's startup deadline
        self.fatal: Finding | None = None
        self.findings: deque[tuple[float, Finding]] = deque(maxlen=KEPT_FINDINGS)

    def new_generation(self) -> None:
        """A fresh engine process: forget the last one's progress and its fatal line."""
        self.starting = True
        self.progress = self.progress_at = self.progress_trio = None
        self.fatal = None
        self.findings.clear()

    def feed(self, block: bytes) -> None:
        """A block of whole lines (a log pump watcher)."""
        if self.starting:
            self._progress(block)
        for _, finding in match_block(block, self.signatures):
            self.findings.append((time.time(), finding))
            if finding.signature.fatal and self.starting and self.fatal is None:
                self.fatal = finding
                if self.on_fatal is not None:
                    self.on_fatal()

    def feed_partial(self, tail: bytes) -> None:
        """The end of a line still being redrawn (a progress bar; a partial log pump watcher)."""
        if self.starting:
            segments = tail.split(b"\r")
            # The last segment may be half-written; the one before it is a whole redraw.
            self._progress(segments[-2] if len(segments) > 1 else tail)

    def _progress(self, block: bytes) -> None:
        # The latest progress line is at the end: a flood is searched in its last part only.
        if len(block) > PROGRESS_TAIL_BYTES:
            block = block[block.find(b"\n", len(block) - PROGRESS_TAIL_BYTES) + 1 :]
        if not any(n in block for n in _PROGRESS_NEEDLES):
            return
        matches = list(PROGRESS.finditer(block))
        if not matches:
            return
        text = matches[-1].group().decode("utf-8", "replace").split("\r")[-1].strip()
        self.progress = text[:PROGRESS_TEXT_CHARS]
        self.progress_at = time.time()
        self.progress_trio = trio.current_time()  # compared with the supervisor's trio deadlines

    def diagnosis(self, *, recent_only: bool = False) -> Finding | None:
        """The signature that explains most of what the log showed (``recent_only``: the last
        ``RECENT_S``), or None."""
        now = time.time()
        return best(f for at, f in self.findings if not recent_only or now - at <= RECENT_S)
