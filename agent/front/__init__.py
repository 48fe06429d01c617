"""The front door: the job's one stable OpenAI-compatible address, served by the head agent in
front of TileRT's router (docs/agent.md, "The front door").

- ``app``: ``Front``, the ASGI app (``/v1/models``, ``/health``, chats and completions), served
  with ``agent.web.asgi`` on hypercorn.
- ``admission``: ``Admission``, no more requests at the router than it has decodes; the rest
  wait in one FIFO queue bounded in length and time (pure trio).
- ``ticket``: ``Ticket``, one request from its arrival to its last byte: its outcome, timings and
  figures counted in this one place, its slot given back once.
- ``proxy``: the way to the router: its URL asked at every try, a wait while it is handed over,
  tries again before the client's first byte.
- ``relay``: ``Relay``, one request sent and its reply passed on (a refusal, a whole reply, a
  stream event by event, a cut continued or marked), the front door's and the service front's;
  its ``Way`` says what may cut it and where the next try goes.
- ``upstream``: the client to the router: h11 on trio's streams, kept-alive connections per
  router (``HttpxUpstream``: an httpx transport handed in, the router in process, for tests).
- ``retry``: which failures are tried again, the pause, the budget (pure).
- ``resume``: a stream cut after its first byte continued by a new request (the conversation
  plus the text already sent), its chunks rewritten into the first stream's
  (``agent.front.resume``); or marked when it cannot be.
- ``sse``: a proxied stream event by event; a cut stream marked with the ``stream_truncated``
  error event; ``StreamReader``, the one reader of TileRT's event stream (the proxy, the relay and
  the head's canaries).
- ``answers``: what a front answers itself in OpenAI's error shape (a bad body, the router's
  refusal, the queue's 429); the service front (``agent.service.front``) answers with them too.
- ``openai``: ``/v1/models``, what TileRT 0.1.6 cannot serve, OpenAI's error shape (pure).
- ``figures``: the ``tilert_front_*`` series, in the registry the head agent hands over.

May import: the standard library, trio, h11, httpx, msgspec, prometheus_client, ``agent.web``,
``agent.errors`` and ``agent.job`` (its settings, ``agent.job.frontpolicy``). Imported by
``agent.head`` (which runs it) and ``agent.nodeagent`` (which builds its figures).
"""

from agent.front.app import Front
from agent.front.figures import FrontFigures
from agent.front.proxy import RouterNow

__all__ = ["Front", "FrontFigures", "RouterNow"]
