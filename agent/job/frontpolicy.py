"""The front door's settings (recipe ``agent.front``, carried in the plan as is).

The front door is the job's one stable OpenAI-compatible address, served by the head agent in front
of the router (docs/agent.md, "The front door"). These are its port, how many requests may wait
for a free decode and how long (its queue), how much it may spend saving a request that failed
before its first byte reached the client, and whether a stream cut after it is continued.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

DEFAULT_FRONT_PORT = 8080
MiB = 1 << 20


class FrontRetry(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """``agent.front.retry``: a request failed before its first byte is tried again within both."""

    # Tries in all (1: never retried). Waiting for a router being handed over is not a try.
    attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5
    # Seconds from the moment the request is let in by the queue (its wait there is bounded by
    # ``queue.max_wait_s``): it must cover a router hand-over (its own start).
    budget_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0


class FrontQueue(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """``agent.front.queue``: requests beyond the router's free decodes wait at the front, in
    arrival order, within both bounds; past either they are answered 429 with Retry-After."""

    # Requests waiting at most; one more is answered 429 at once (0: none waits).
    max_waiting: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 1024
    # Seconds a request may wait for a free decode; then it is answered 429.
    max_wait_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 300.0


class FrontPolicy(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """``agent.front``: the front door's port, queue, retries, bounds and resume."""

    # Where the head starts probing for a free port at its start; fixed for the job's life then.
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = DEFAULT_FRONT_PORT
    retry: FrontRetry = msgspec.field(default_factory=FrontRetry)
    queue: FrontQueue = msgspec.field(default_factory=FrontQueue)
    # A request body larger than this is refused with 413.
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 30)] = 8 * MiB
    # A client that has not sent its whole body within this is answered 408.
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    # A plain chat's stream cut by a dead decode is continued by a new request (the
    # conversation plus the text already sent), so the client sees one whole stream; false:
    # the cut is marked with the ``stream_truncated`` error event (agent.front.resume).
    resume: bool = True
