"""The job directory and the formats in it: what the submitter and every agent read and write.

``vocab`` holds the job's typed words (roles and the states of engines, agents, the job and its
benchmark); ``paths`` knows every path and mode in ``J/``; ``plan`` is ``J/plan.json``; ``pool`` is
``J/pool.json`` (the decode pool ``tilert-submit scale`` asks for); ``records``
holds the rendezvous record, an agent's ``/status`` and ``status.json``; ``benchmark`` the
benchmark's part of the plan, its status block and ``J/benchmark/summary.json``; ``names`` builds
and parses the names of agents and the router, ``urls`` the job's HTTP addresses (the router's,
the front door's); ``logfiles`` is the log layout, ``logtimes`` the
receive-time index beside each engine log, and ``logtail`` reads logs (history, since, follow, the
wire form); ``atomicfile`` writes files that others read; ``secrets`` decides what is masked.

May import: the standard library, msgspec, trio (``logtail`` only, and only once it follows),
``agent.facts``, ``agent.problems`` and ``agent.errors``. Nothing here starts a process or opens
a socket.
"""
