"""The service: several cells (each an ordinary job) behind one service front whose address
outlives every cell (docs/service.md).

- ``paths``: ``ServiceDir``, every path in a service directory ``S/`` (``S/cells/`` holds the
  cells' job directories).
- ``records``: ``S/service.json`` (``ServiceStatus``, one ``CellRecord`` per cell): the front
  writes it, ``tilert-submit status/stop`` and a restarted front read it.
- ``cellslots``: ``CellSlots``, which cell gets the next request (a ready cell with a free
  decode; none free: the one FIFO queue), a cell leaving the table, a cell cut.
- ``front``: ``ServiceFront``, the service front's ASGI app: chats and completions sent to the
  cells' front doors, ``/v1/models``, ``/health``, ``/metrics``; ``set_cells``/``cut`` for the
  control plane.
- ``figures``: ``ServiceFigures``, every ``tilert_service_*`` series in its own registry.
- ``listen``: the listening socket systemd passes (socket activation), so the service's address
  is held while the front restarts.
- ``succession``: the control plane's rules: the successor lead, when a successor is due, the
  cells' lines, replacements with backoff and an hourly bound, at most ``max_cells`` live cells.
- ``launcher``: ``CellLauncher``, how the keeper starts, watches and stops cells (the launchers
  are ``submit.servecells``').
- ``keeper``: ``CellKeeper``, the control plane's loop: cells' states, successions, retirement,
  replacement, adoption after a restart, ``service.json`` and ``targets.json``.

May import: the standard library, trio, httpx, msgspec, prometheus_client, ``agent.errors``,
``agent.problems``, ``agent.job``, ``agent.web``, ``agent.front`` (the front door's pieces it
reuses), ``agent.node`` (the folder lock) and ``agent.recipe``. Imported by ``submit`` (which runs
the service front: ``tilert-submit serve``).
"""
