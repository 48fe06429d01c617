"""How a stand-in process lives: parse like its engine, load, serve, crash on cue, stop on SIGTERM.

Unknown flags are accepted and logged (the stand-ins take the real engines' argument lists);
the engines' own exit codes are kept: 2 for a bad known flag (argparse), 1 for a startup error
(traceback), and the real engine's code on SIGTERM (TileRT 143, vLLM 0).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

import trio

from agent.standins.faults import Crasher, FaultConfigError, Faults

log = logging.getLogger("standin")

Body = Callable[[trio.Nursery, Crasher, trio.Event], Awaitable[None]]


def parse_known(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse the flags a stand-in honours; log (and otherwise ignore) the rest."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        log.info("stand-in ignores flags it does not emulate: %s", " ".join(unknown))
    return args


def setup_logging(fmt: str, datefmt: str | None = None) -> None:
    """Log to stderr in the real engine's format."""
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt=datefmt, stream=sys.stderr)
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)


def load_faults() -> Faults:
    """The fault switches, or exit 2 naming the bad variable."""
    try:
        return Faults.from_env()
    except FaultConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


async def loading(faults: Faults, shutdown: trio.Event) -> bool:
    """Sleep through the startup delay (ports still unbound); False when stopped meanwhile."""
    with trio.move_on_after(faults.startup_delay_s):
        await shutdown.wait()
    return not shutdown.is_set()


async def _live(name: str, faults: Faults, body: Body) -> None:
    shutdown = trio.Event()
    crasher = Crasher(faults, name)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch_signals() -> None:
                async for signum in signals:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    shutdown.set()

            nursery.start_soon(watch_signals)
            nursery.start_soon(crasher.run)
            await body(nursery, crasher, shutdown)
            nursery.cancel_scope.cancel()


def run(name: str, faults: Faults, body: Body, *, term_exit_code: int) -> None:
    """Run ``body`` until it returns (after SIGTERM/SIGINT), then exit with ``term_exit_code``."""
    if faults != Faults():
        log.info("%s stand-in fault switches: %s", name, faults.describe())
    trio.run(_live, name, faults, body)
    logging.shutdown()
    raise SystemExit(term_exit_code)
