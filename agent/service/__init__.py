"""The service: several cells (each an ordinary job) behind one service front whose address
outlives every cell (docs/service.md).

- ``paths``: ``ServiceDir``, every path in a service directory ``S/`` (``S/cells/`` holds the
  cells' job directories).
- ``records``: ``S/service.json`` (``ServiceStatus``, one ``CellRecord`` per cell): the front
  writes it, ``tilert-submit status/stop`` and a restarted front read it.
- ``listen``: the listening socket systemd passes (socket activation), so the service's address
  is held while the front restarts.

May import: the standard library, trio, httpx, msgspec, prometheus_client, ``agent.errors``,
``agent.problems``, ``agent.job``, ``agent.web``, ``agent.front`` (the front door's pieces it
reuses), ``agent.node`` (the folder lock) and ``agent.recipe``. Imported by ``submit`` (which runs
the service front: ``tilert-submit serve``).
"""
