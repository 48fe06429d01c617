"""The agent's own log: ``agent.log`` (size-rotated) and stderr, every line prefixed."""

import logging
import logging.handlers
import sys
import time
from pathlib import Path

from agent.job.logfiles import DEFAULT_LOG_BACKUPS, DEFAULT_LOG_MAX_BYTES
from agent.job.paths import PRIVATE_DIR_MODE

# ---- agent.log ----

_HANDLER_MARK = "_tilert_agent_handler"


class _LineFormatter(logging.Formatter):
    """``2026-12-02T11:22:33.123Z decode-0 INFO message``, the prefix repeated on every line."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.agent_name = name

    def format(self, record: logging.LogRecord) -> str:
        """One or more prefixed lines (multi-line messages and tracebacks stay greppable)."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        prefix = f"{stamp}.{int(record.msecs):03d}Z {self.agent_name} {record.levelname} "
        body = record.getMessage()
        if record.exc_info:
            body += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            body += "\n" + self.formatStack(record.stack_info)
        return "\n".join(prefix + line for line in body.splitlines() or [""])


class _AgentLogFile(logging.handlers.RotatingFileHandler):
    """``agent.log`` that may become unwritable (full disk, read-only or removed job directory).

    The agent goes on (its engines keep serving); stderr gets one line per kind of error, not
    logging's traceback for every record.
    """

    _failing = ""  # the error of the last record that could not be written
    _failed_now = False

    def emit(self, record: logging.LogRecord) -> None:
        """Write ``record``; note a recovery once."""
        self._failed_now = False
        super().emit(record)
        if self._failing and not self._failed_now:
            self._failing = ""
            print(f"{self.baseFilename} is written again", file=sys.stderr)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: ARG002 (logging's signature)
        """Say once per kind of error that ``agent.log`` cannot be written (no traceback)."""
        exc = sys.exc_info()[1]
        error = getattr(exc, "strerror", None) or str(exc)
        if error != self._failing:
            print(f"cannot write {self.baseFilename}: {error}", file=sys.stderr)
        self._failing, self._failed_now = error, True


def setup_agent_logging(
    path: Path,
    *,
    name: str,
    level: int = logging.INFO,
    stderr: bool = True,
    max_bytes: int = DEFAULT_LOG_MAX_BYTES,
    backups: int = DEFAULT_LOG_BACKUPS,
) -> logging.Logger:
    """Send all logging to ``path`` (size-rotated) and stderr; returns the ``agent`` logger."""
    path.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
        old.close()
    formatter = _LineFormatter(name)
    handlers: list[logging.Handler] = [
        _AgentLogFile(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
    ]
    if stderr:
        handlers.append(logging.StreamHandler(sys.stderr))
    for handler in handlers:
        handler.setFormatter(formatter)
        setattr(handler, _HANDLER_MARK, True)
        root.addHandler(handler)
    root.setLevel(level)
    # One line per HTTP request (every probe) would drown the log.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(max(level, logging.WARNING))
    return logging.getLogger("agent")
