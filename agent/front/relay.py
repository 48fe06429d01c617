"""One request sent and its reply passed on: the one send-then-relay of the front door
(``agent.front.app``) and of the service front (``agent.service.front``).

A ``Relay`` sends a request the way its ``Way`` says (the front door's: the router, never cut;
the service front's: its cell, ``agent.service.cellslots.Route``, which a failed cell cuts) and
answers the client: a refusal, a whole reply, or the stream passed on event by event as it
arrives. What it keeps for both: the request's ``Ticket`` (its outcome, its first byte, its slot
held until the stream ends), tries again before the first byte (``agent.front.proxy``), the
upstream reply closed shielded however the stream ends, ``cancelled`` when the client leaves.

What may cut a request is the way's: each step at it (a try before the first byte, each read of
its stream) runs in ``Way.guarded``, whose scope a cut cancels. A try cut goes elsewhere
(``Way.move``); a stream cut (its way cut, its stream broken or ended in an error) is continued
by a new request (``agent.front.resume``: the conversation plus the text already sent) sent the
way ``Way.move`` chose (another cell; the front door's router picks the next free decode), the
client seeing one stream, counted ``resumed``; where it cannot be continued, the cut is marked
with the ``stream_truncated`` error event (``agent.front.sse``), counted ``truncated``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AbstractContextManager, aclosing
from typing import Any, Protocol

import trio

from agent.front.answers import refused, unavailable
from agent.front.figures import Outcome
from agent.front.openai import wants_usage
from agent.front.proxy import Opened, Proxy, Refused, StreamStart, Unavailable
from agent.front.resume import Resume, why_not
from agent.front.sse import StreamWatch
from agent.front.ticket import Ticket
from agent.front.upstream import Reply, UpstreamError
from agent.web.asgi import Response, StreamingResponse

SSE = "text/event-stream; charset=utf-8"
CUT_EVERY_TRY = "the request was cut before its first byte at every try"


class Caught(Protocol):
    """What a guarded step says once it is over (``trio.CancelScope``'s)."""

    @property
    def cancelled_caught(self) -> bool:
        """The step was cancelled by a cut."""


class Way(Protocol):
    """Where a request's tries go, as the relay needs it: what may cut them, and where the next
    goes after a failed try or a cut."""

    def guarded(self) -> AbstractContextManager[Caught]:
        """One step at the way (a try, a read of the stream) that a cut of it cancels."""

    def move(self) -> None:
        """A try failed before its first byte, or the stream was cut: the next goes elsewhere."""

    def cut_why(self) -> str:
        """Why a guarded step was cancelled, in words (the cut's mark)."""


class _Never:
    """A step nothing cuts (the front door's): no cancel scope per read."""

    cancelled_caught = False

    def __enter__(self) -> _Never:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None


NEVER = _Never()


class ToRouter:
    """The front door's way: the job's router, never cut; the router itself gives the next try
    (and a continuation) to its next free decode."""

    def guarded(self) -> AbstractContextManager[Caught]:
        """A step nothing cuts."""
        return NEVER

    def move(self) -> None:
        """Nothing to choose: the router chooses the decode."""

    def cut_why(self) -> str:
        """Never asked: nothing cuts the router's way."""
        return "cut"


class Relay:
    """One request at its way and its reply to the client, counted on its ``ticket``
    (``unavailable_outcome``: the outcome of a 503 when nothing can take it; ``cut_reason``:
    the try-again reason of a try its way cut)."""

    def __init__(
        self,
        proxy: Proxy,
        ticket: Ticket,
        *,
        way: Way,
        resume: bool,
        unavailable_outcome: Outcome,
        log: logging.Logger,
        who: str = "front",
        cut_reason: str = "cut",
    ) -> None:
        self.proxy = proxy
        self.ticket = ticket
        self.way = way
        self.resume = resume
        self.unavailable_outcome = unavailable_outcome
        self.log = log
        self.who = who
        self.cut_reason = cut_reason

    def retried(self, reason: str) -> None:
        """A try failed before its first byte (``reason``): counted, the next one elsewhere."""
        self.ticket.retried(reason)
        self.way.move()

    async def answer(
        self, path: str, body: bytes, value: dict[str, Any]
    ) -> Response | StreamingResponse:
        """The request (``body``, read as ``value``) at its way, within its slot: a refusal, a
        whole reply, or its stream."""
        ticket = self.ticket
        usage = wants_usage(value)
        resume = None
        if self.resume and why_not(path, value) is None:
            resume = Resume(path, value, usage)
        stream = bool(value.get("stream"))
        new_watch = None if resume is None else resume.first_watch
        try:
            result = await self.send(path, body, stream, usage, new_watch)
        except Unavailable as exc:
            return ticket.answer(unavailable(str(exc)), self.unavailable_outcome)
        if result is None:
            return ticket.answer(unavailable(CUT_EVERY_TRY), "failed")
        if isinstance(result, Refused):
            return ticket.answer(*refused(result))
        if result.stream is None:
            ctype = result.response.content_type
            return ticket.answer(Response(result.body, 200, ctype), ticket.served())
        reply = result.response

        async def closed() -> None:
            # The relay's own ``finally`` ends the ticket; this covers a relay that never ran
            # (the response cancelled before its first chunk): the upstream's stream closed, the
            # slot given back. Both are no-ops after the relay's end.
            await reply.aclose()
            ticket.end("cancelled")

        chunks = self._relay(reply, result.stream, resume)
        return StreamingResponse(chunks, 200, SSE, {"cache-control": "no-cache"}, closed)

    async def send(
        self,
        path: str,
        body: bytes,
        stream: bool,
        want_usage: bool,
        new_watch: Callable[[], StreamWatch] | None,
    ) -> Opened | Refused | None:
        """``body`` tried at the way (``Proxy.send``) until an answer passes; a try its way cut
        goes elsewhere (None: every try was cut)."""
        for _ in range(self.proxy.budget.attempts):
            with self.way.guarded() as scope:
                result = await self.proxy.send(
                    path,
                    body,
                    stream=stream,
                    on_retry=self.retried,
                    want_usage=want_usage,
                    new_watch=new_watch,
                )
            if not scope.cancelled_caught:
                return result
            self.retried(self.cut_reason)  # cut before its first byte: another place's turn
        return None

    async def _relay(
        self, response: Reply, start: StreamStart, resume: Resume | None
    ) -> AsyncIterator[bytes]:
        """The stream passed on as it arrives (a cut continued by ``resume``); its ticket ended
        when it ends (its slot given back once the upstream reply ended: the decode is free by
        then)."""
        watch = start.reader.watch
        finished = False
        try:
            self.ticket.first_byte()
            async with aclosing(self._events(response, start)) as events:
                async for out in events:
                    yield out
            if watch.truncated and resume is not None:
                self.log.warning(
                    "%s: a stream was cut, continuing it: %s", self.who, watch.truncated
                )
                async with aclosing(self._continued(resume, watch)) as events:
                    async for out in events:
                        yield out
            finished = True
        finally:
            with trio.CancelScope(shield=True):
                await response.aclose()
            last = watch if resume is None or resume.last is None else resume.last
            self._end(last, finished, resume)

    def _end(self, last: StreamWatch, finished: bool, resume: Resume | None) -> None:
        """The stream's ticket ended by how its last part ended: a cut marked counts as truncated
        even when the client left on its error event; a client that left while its cut was being
        continued (it saw no cut), or before the end, as cancelled; one that left the moment it
        read the end was served all the same."""
        if last.truncated and (resume is None or resume.marked):
            self.log.warning("%s: a stream was cut: %s", self.who, last.truncated)
            self.ticket.end("truncated")
        elif not (finished or last.done):
            self.ticket.end("cancelled")
        else:
            resumed = resume is not None and resume.count > 0
            self.ticket.end("resumed" if resumed else self.ticket.served())

    async def _events(self, response: Reply, start: StreamStart) -> AsyncGenerator[bytes, None]:
        """One upstream stream begun (``start``) passed on as it arrives, to its end (a cut, a
        break or a cut of its way marked by its watch, or left to a continuation); its reply
        closed however it ends. Only the wait for the way is guarded: a cut never lands in the
        client's send."""
        reader = start.reader
        try:
            if start.first:
                yield b"".join(start.first)
            while True:
                with self.way.guarded() as scope:
                    try:
                        out = await reader.read()
                    except UpstreamError as exc:
                        self.log.warning("%s: the upstream stream broke: %r", self.who, exc)
                        out = None
                if scope.cancelled_caught or out is None:
                    cut = scope.cancelled_caught
                    if tail := reader.cut(self.way.cut_why()) if cut else reader.end():
                        yield tail
                    return
                if out:
                    yield out
        finally:
            with trio.CancelScope(shield=True):
                await response.aclose()

    async def _continued(self, resume: Resume, cut: StreamWatch) -> AsyncGenerator[bytes, None]:
        """After ``cut`` (the first stream) was cut: the continuations' events, each sent where
        the way moved; the cut marked when it cannot be continued."""
        resume.begin(cut)
        watch = cut
        while watch.truncated is not None:
            body = resume.next_body(watch)
            opened = start = None
            if body is not None:
                self.way.move()
                opened = await self._open(resume, body)
                start = None if opened is None else opened.stream
            if opened is None or start is None:
                resume.marked = True
                yield b"".join(watch.cut_events(resume.sent - watch.chunks))
                return
            self.log.info("%s: a cut stream continued: %s", self.who, watch.truncated)
            watch = start.reader.watch
            resume.opened(watch)
            async with aclosing(self._events(opened.response, start)) as events:
                async for out in events:
                    yield out

    async def _open(self, resume: Resume, body: bytes) -> Opened | None:
        """The continuation at the way (None: refused, cut, or nothing within the budget)."""
        try:
            result = await self.send(resume.path, body, True, resume.want_usage, resume.next_watch)
        except Unavailable as exc:
            self.log.warning("%s: a cut stream could not be continued: %s", self.who, exc)
            return None
        if not isinstance(result, Opened):
            why = CUT_EVERY_TRY if result is None else result.failure
            self.log.warning("%s: a cut stream could not be continued: %s", self.who, why)
            return None
        return result
