"""Serving an app on a bound socket: hypercorn's HTTP/1.1 connections, each one contained.

``hypercorn.trio.serve`` runs every connection in one nursery: whatever one connection raises
ends the server, every stream it carries, and climbs into the caller's nursery (the head's: the
job fails). pgjones/hypercorn#203, open in hypercorn 0.18.0 (the latest release), is such a
raise: a ``Connection: close`` request followed by stray bytes makes hypercorn half-close the
socket (``send_eof``, outside its send lock) while another of its tasks sends on it, and trio
raises ``BusyResourceError`` (docs/reliability.md, "Servers contained"). So this module runs
hypercorn's own connection (``TCPServer``) with that close taken under the send lock, each
connection in a task of its own whose failure is logged once and closes that connection alone,
and an accept loop that, when accepting fails, accepts again on the same socket. Cancellation
still ends it all; ``shutdown`` stops accepting and gives open connections ``GRACE_S``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable

import hypercorn.config
import trio
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState
from hypercorn.utils import wrap_app

from agent.web.asgi import App

# Open connections' time to finish once ``shutdown`` is set, and a close's wait for a send under
# way (a client that reads nothing must not hold a close for ever).
GRACE_S = 1.0
CLOSE_WAIT_S = 5.0
KEEP_ALIVE_S = 75.0
# Accepting again after a failure (EMFILE, ...): the first pause, doubled up to the last.
ACCEPT_PAUSE_S = (0.1, 5.0)

log = logging.getLogger(__name__)


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``::`` is dual-stack), ready to hand to
    ``serve``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


class _Connection(TCPServer):
    """One client connection: hypercorn's, its close serialised with its sends (#203)."""

    async def _close(self) -> None:
        # hypercorn half-closes with send_eof, which holds the stream's send slot across a
        # checkpoint without the send lock: a send in another task then raises BusyResourceError.
        # Taking the lock makes the close wait for a send under way (bounded) and a later send
        # find the stream closed (ClosedResourceError, which hypercorn expects).
        if self.send_lock.statistics().owner is trio.lowlevel.current_task():
            await super()._close()
            return
        with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_WAIT_S):
            async with self.send_lock:
                await super()._close()
                return
        with trio.CancelScope(shield=True):  # the send never finished: close under it
            await self.stream.aclose()


class Accepting:
    """The accept loop of one socket and the containment of its connections' failures: shared
    by this module's server and ``agent.web.h11server``."""

    def __init__(self, connection: Callable[[trio.SocketStream], Awaitable[None]]) -> None:
        self.connection = connection
        self.seen: set[str] = set()

    async def contained(self, stream: trio.SocketStream) -> None:
        """One connection served; what it raises is logged and ends it alone."""
        try:
            await self.connection(stream)
        except* Exception as group:
            self._contained(group)

    def _contained(self, group: BaseExceptionGroup[Exception]) -> None:
        """Log a contained failure: its traceback the first time its kind is seen, a line after."""
        kinds = ", ".join(sorted({type(e).__name__ for e in group.exceptions}))
        first = kinds not in self.seen
        self.seen.add(kinds)
        log.warning(
            "a connection failed (%s: %s); it alone is closed, serving goes on",
            kinds,
            "; ".join(str(e) for e in group.exceptions)[:300],
            exc_info=group if first else None,
        )

    async def accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept connections into ``nursery`` for ever; a failure is logged once per run of
        failures and accepting goes on on the same socket after a pause."""
        pause, longest = ACCEPT_PAUSE_S
        failing = False
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                raise  # closed under us (our own bug): no accepting again can serve it
            except Exception as exc:  # EMFILE, ENOBUFS, ...: never the end of serving
                if not failing:
                    log.warning("accepting a connection failed: %r; accepting again", exc)
                failing = True
                await trio.sleep(pause)
                pause = min(pause * 2, longest)
                continue
            failing, pause = False, ACCEPT_PAUSE_S[0]
            nursery.start_soon(self.contained, stream)


def listener_of(sock: socket.socket) -> trio.SocketListener:
    """A trio listener that owns ``sock`` from here: the caller's object is detached, so that
    collecting it (or detaching it again) cannot close a descriptor number reused later."""
    own = socket.socket(sock.family, sock.type, fileno=sock.detach())
    return trio.SocketListener(trio.socket.from_stdlib_socket(own))


class _Server(Accepting):
    """hypercorn's connections of one app."""

    def __init__(self, app: App) -> None:
        super().__init__(self.connection_of)
        config = hypercorn.config.Config()
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        config.loglevel = "WARNING"
        config.keep_alive_timeout = KEEP_ALIVE_S
        self.config = config
        self.app: AppWrapper = wrap_app(app, config.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]
        self.context = WorkerContext(None)

    async def connection_of(self, stream: trio.SocketStream) -> None:
        """One connection served by hypercorn."""
        server = _Connection(self.app, self.config, self.context, ConnectionState({}), stream)  # type: ignore[arg-type]
        await server.run()


async def serve(
    app: App,
    sock: socket.socket,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    shutdown: trio.Event | None = None,
) -> None:
    """Serve ``app`` on an already bound socket until cancelled (or until ``shutdown`` is set,
    when open connections get ``GRACE_S``); the socket is closed when it returns."""
    server = _Server(app)
    await serving(server, server.context.terminated.set, sock, task_status, shutdown)


async def serving(
    accepting: Accepting,
    shut: Callable[[], Awaitable[None]],
    sock: socket.socket,
    task_status: trio.TaskStatus[None],
    shutdown: trio.Event | None,
) -> None:
    """Accept on ``sock`` until cancelled or ``shutdown``; then ``shut`` (idle connections
    close) and the open ones get ``GRACE_S``: one server's life, whichever server it is."""
    listener = listener_of(sock)  # closed at the end
    try:
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as accepting_now:
                accepting_now.start_soon(accepting.accept, listener, connections)
                task_status.started()
                if shutdown is None:
                    await trio.sleep_forever()
                await shutdown.wait()
                accepting_now.cancel_scope.cancel()
            await shut()
            connections.cancel_scope.deadline = trio.current_time() + GRACE_S
    finally:
        with trio.CancelScope(shield=True):
            await listener.aclose()
