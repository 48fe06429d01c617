"""What an agent serves over HTTP, and what it scrapes.

``endpoint`` (served with the ASGI toolkit ``agent.web.asgi``) is the agent's ``/healthz``,
``/status`` (long-poll), ``/metrics`` and ``/logs``; ``metrics`` is the agent's own Prometheus
registry; ``decodemetrics`` its ``tilert_decode_*`` series; ``reexport`` relabels vLLM's page
with our labels and ``upstream`` fetches it for the re-export; ``client`` is the agent's one HTTP
client (probes, canaries, the vLLM scrape); ``longpoll`` the head's long polls of each peer's
``/status`` over a bare HTTP/1.1 connection (cheap enough for 1,024 peers).

May import: the standard library, trio, httpx, psutil, msgspec, prometheus_client,
``agent.problems``, ``agent.errors``, ``agent.web``, ``agent.job`` and ``agent.node``. Never
``agent.head`` or ``agent.nodeagent``.
"""
