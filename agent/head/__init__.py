"""The head agent's job, run inside prefill-0's node agent: follow every agent, gate, start and
prove the router, keep the job serving, and write status.json and targets.json.

- ``context``: ``HeadContext``, what the node agent hands over (plan, job, identity, launcher,
  hooks); the head never imports the node agent.
- ``peers``: each agent's record and long-polled ``/status``.
- ``decisions``: gate, drop, fatal, the router's decode list (``router_list``) and the job's
  state, as plain functions over a ``JobView``.
- ``poolkeeper``: ``PoolKeeper``, the one owner of the decodes (members, dropped, resting,
  joining, leaving) and of every change of the router's list (drop, rejoin, rest, scale).
- ``router``: the router's preflight, start and relaunch (a hand-over); ``canaries``: the
  streaming chat check; ``trial``: a trial router proving decodes joining the pool; ``proof``:
  ready means proven (canaries at the start and after every restart).
  ``starved``: a router alive but too busy to answer ``/health`` is not killed for it.
- ``verify``: the verified canary, each decode's answers judged against the prefill's own model;
  ``answers``: which decodes answered wrong (``failed`` in the head's view until they restart).
- ``pool``: the decode pool ``tilert-submit scale`` asks for (``J/pool.json``) and where each
  decode stands in it.
- ``benchstage``: the recipe's benchmark, checked before the load and run once ready.
- ``frontdoor``: the job's front door (``agent.front``), served from the head's start, told where
  the router is and whether its pool is whole at every request.
- ``head``: ``Head``, which runs them in order, writing status.json and targets.json through
  ``agent.node.statuswriter`` (a convert job writes its status.json with it too).
- ``duties``: what a node agent runs beside its engine, composed by ``agent.nodeagent``:
  nothing for a worker (``Duties``), the head, its ports and figures for prefill-0
  (``HeadDuties``).

May import: ``agent.facts``, ``agent.problems``, ``agent.errors``, ``agent.signatures``,
``agent.job``, ``agent.launch``, ``agent.node``, ``agent.benchmark``, ``agent.http``,
``agent.front``, ``agent.web`` (the front door's socket). Imported by ``agent.nodeagent`` only.
"""

from agent.head.context import HeadContext
from agent.head.decisions import JobFailed, JobView
from agent.head.head import Head

__all__ = ["Head", "HeadContext", "JobFailed", "JobView"]
