"""The verdict of a level, never a silent pass: what makes a measurement worthless is a failure.

A level fails when the client exited non-zero, wrote no results, measured no output token (a job
that answers nothing "succeeds" in many benchmark clients: srtctl users met it), saw more failed
requests than ``max_error_rate`` allows, or completed fewer requests than it was asked to send.
The first failed level fails the run; its reason names the level.
"""

from __future__ import annotations

from agent.launch.spec import exit_description


def exit_words(code: int) -> str:
    """How a client ended, in words: ``exited with status 3``, or ``was killed by SIGKILL``."""
    return exit_description(code, noun="status")


def level_failure(
    *,
    concurrency: int,
    exit_code: int | None,
    requests_ok: int,
    requests_failed: int,
    output_tokens: int,
    requested: int | None,
    max_error_rate: float,
    results_error: str | None,
    request_error: str | None,
    client_said: str | None,
    where: str | None = None,
) -> str | None:
    """Why the level at ``concurrency`` failed, or None when it passed. ``where``: how the
    reason names the level (default ``concurrency N``)."""
    where = where or f"concurrency {concurrency}"
    total = requests_ok + requests_failed
    exited = f"; the client {exit_words(exit_code)}" if exit_code else ""
    if output_tokens == 0 and total:
        cause = f": {requests_failed} failed ({request_error})" if request_error else ""
        return f"{where}: 0 output tokens in {total} request(s){cause}{exited}"
    if exit_code:
        detail = f": {client_said}" if client_said else ""
        return f"{where}: the client {exit_words(exit_code)}{detail}"
    if results_error is not None:
        return f"{where}: {results_error}"
    if output_tokens == 0:
        return f"{where}: 0 output tokens: no request completed"
    rate = requests_failed / total if total else 0.0
    if rate > max_error_rate:
        cause = f"; most frequent: {request_error}" if request_error else ""
        return (
            f"{where}: {requests_failed} of {total} requests failed ({rate:.0%}), more than "
            f"max_error_rate {max_error_rate:g}{cause}"
        )
    if requested is not None and total < requested:
        return f"{where}: only {total} of {requested} requests completed"
    return None
