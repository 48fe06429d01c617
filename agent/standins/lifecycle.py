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

from agent.standins.failmodes import Program, print_failure
from agent.standins.faults import Crasher, FaultConfigError, Faults

log = logging.getLogger("standin")

# Said by every stand-in's --help under the flags it emulates (the preflight reads that list).
HELP_EPILOG = (
    "A stand-in: other flags of the real engine are accepted and ignored (logged at start)."
)

Body = Callable[[trio.Nursery, Crasher, trio.Event], Awaitable[None]]


def parse_known(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse the flags a stand-in honours; log (and otherwise ignore) the rest."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        log.info("stand-in ignores flags it does not emulate: %s", " ".join(unknown))
    return args


def setup_logging(
    fmt: str, datefmt: str | None = None, formatter: logging.Formatter | None = None
) -> None:
    """Log to stderr in the real engine's format (``formatter``: one of its own making)."""
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt=datefmt, stream=sys.stderr)
    if formatter is not None:
        for handler in logging.getLogger().handlers:
            handler.setFormatter(formatter)
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)


def load_faults() -> Faults:
    """The fault switches, or exit 2 naming the bad variable."""
    try:
        return Faults.from_env()
    except FaultConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


async def loading(faults: Faults, shutdown: trio.Event, program: Program) -> bool:
    """Sleep through the startup delay (ports still unbound), showing progress if asked; then
    print the failure asked for (a startup one ends the process). False when stopped meanwhile."""
    with trio.move_on_after(faults.startup_delay_s):
        if faults.progress_every_s:
            await _show_progress(faults.progress_every_s, faults.startup_delay_s)
        await shutdown.wait()
    if shutdown.is_set():
        return False
    print_failure(faults.failure, program, "start")
    print_failure(faults.failure, program, "serve")
    return True


async def _show_progress(every_s: float, total_s: float) -> None:
    """vLLM's weight loading bar, redrawn with a carriage return (tqdm), one shard per step."""
    shards = max(1, int(total_s / every_s))
    t0 = trio.current_time()
    for done in range(shards + 1):
        elapsed = trio.current_time() - t0
        end = "\n" if done == shards else "\r"
        sys.stderr.write(
            f"Loading safetensors checkpoint shards: {100 * done // shards:3d}% Completed | "
            f"{done}/{shards} [{int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}<?, ?it/s]{end}"
        )
        sys.stderr.flush()
        if done < shards:
            await trio.sleep(every_s)


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
