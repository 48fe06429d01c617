"""The tests' helpers: one home for running, waiting on and reading jobs and agents.

``from tests import kit`` and use ``kit.NAME``; every public name below is re-exported here except
the /metrics page readers, which are imported from ``tests.kit.metrics``. One concept a module:

- ``waiting``: ``wait_for`` (poll a condition, bounded, failing with what it awaited and saw
  last) and ``within`` (the same for trio code). Every wait of the kit that fails on a timeout is
  built on them (``still_alive`` and ``wait_gone`` return what is left instead); no test sleeps
  for something to happen. Product timeouts in unit tests run on trio's clock instead
  (pytest-trio's ``autojump_clock``).
- ``commands``: how the project's commands run (``SUBMIT``, ``AGENT``, ``submit_cmd``,
  ``clean_env``), the repository and the demo recipe.
- ``jobs``: jobs as users make them (``make_job``: a dry run) and run them (``LocalJob``:
  ``--local --mock``), with ports of their own (``isolated_sets``) and the fast settings.
- ``jobdir``: reading a job directory (``status.json``, records, log tails) and waiting on its
  status (``wait_status``, ``wait_state``).
- ``agents``: real ``tilert-agent`` processes (``AgentProc``, ``running_agents``).
- ``endpoints``: the agents' ``/status`` and ``/metrics``, a ``LongPoll`` a test can see held,
  and the router's chat API.
- ``processes``: alive or gone (``still_alive``, ``wait_gone``), a job's processes by scan.
- ``scenarios``: the checks the local and the Slurm end-to-end tests share, and the fault
  overrides they run.
- ``shared``: ``Shared``, a job or agent the tests of a module share without depending on each
  other's order.
- ``metrics``: reading a /metrics page (samples, families, one series).
- ``logs``: `tilert-submit logs` as a user runs it (followers, per-source lines); imported from
  ``tests.kit.logs``.
- ``notifysocket``: a datagram socket in systemd's place, receiving an agent's ``sd_notify``
  notes with the kernel's receive times; imported from ``tests.kit.notifysocket``.
- ``fakelauncher``: an in-memory ``Launcher`` whose engines follow a script (exit, lines,
  ``/health`` answers through an ``httpx.MockTransport``), for supervisor and head tests that
  start no process; imported from ``tests.kit.fakelauncher``.
- ``front``: the front door in process (``FrontKit``): the router on an ``httpx.MockTransport``
  with scripted answers, its state scripted (none, handing over, serving), requests through the
  ASGI app with no socket, on trio's autojump clock; imported from ``tests.kit.front``.
- ``servicefront``: a service front on a real socket from a thread of the test process
  (``FrontThread``: the control plane's calls run in its loop) and a local job as a cell of its
  table (``cell_record``); imported from ``tests.kit.servicefront``.

Free ports come from ``tests/infra/ports.py`` (``free_port``, ``free_ports``), the only place
that picks them.
"""

from tests.kit.agents import AgentProc, Agents, running_agents
from tests.kit.commands import AGENT, DEMO_RECIPE, REPO, SUBMIT, clean_env, submit_cmd
from tests.kit.endpoints import (
    LongPoll,
    agent_status,
    chat,
    chat_concurrently,
    decode_spec,
    get,
    head_status,
    metric_value,
    router_decodes,
    router_serves_without,
)
from tests.kit.jobdir import (
    agent_entry,
    current_status,
    job_ports,
    log_tails,
    read_status,
    record,
    wait_state,
    wait_status,
)
from tests.kit.jobs import CLUSTER_FILE, FAST, LocalJob, isolated_sets, make_job
from tests.kit.processes import (
    agent_process,
    alive,
    assert_gone,
    assert_nothing_left,
    command_lines,
    describe,
    job_processes,
    kill_all,
    running_processes,
    still_alive,
    wait_gone,
)
from tests.kit.scenarios import (
    AGENT_FIELDS,
    AGENTS,
    ANSWER,
    DECODE_CRASH_LOOP,
    DECODES_NEVER_HEALTHY,
    MODEL,
    PREFILL_CRASH_LOOP,
    check_chat,
    check_decode_dropped,
    check_decodes_never_healthy,
    check_engine_sigkill_recovers,
    check_gate_latency,
    check_prefill_failed,
    check_ready_contract,
    check_stopped,
)
from tests.kit.shared import Shared
from tests.kit.waiting import until, wait_for, within

__all__ = [
    "AGENT",
    "AGENTS",
    "AGENT_FIELDS",
    "ANSWER",
    "CLUSTER_FILE",
    "DECODES_NEVER_HEALTHY",
    "DECODE_CRASH_LOOP",
    "DEMO_RECIPE",
    "FAST",
    "MODEL",
    "PREFILL_CRASH_LOOP",
    "REPO",
    "SUBMIT",
    "AgentProc",
    "Agents",
    "LocalJob",
    "LongPoll",
    "Shared",
    "agent_entry",
    "agent_process",
    "agent_status",
    "alive",
    "assert_gone",
    "assert_nothing_left",
    "chat",
    "chat_concurrently",
    "check_chat",
    "check_decode_dropped",
    "check_decodes_never_healthy",
    "check_engine_sigkill_recovers",
    "check_gate_latency",
    "check_prefill_failed",
    "check_ready_contract",
    "check_stopped",
    "clean_env",
    "command_lines",
    "current_status",
    "decode_spec",
    "describe",
    "get",
    "head_status",
    "isolated_sets",
    "job_ports",
    "job_processes",
    "kill_all",
    "log_tails",
    "make_job",
    "metric_value",
    "read_status",
    "record",
    "router_decodes",
    "router_serves_without",
    "running_agents",
    "running_processes",
    "still_alive",
    "submit_cmd",
    "until",
    "wait_for",
    "wait_gone",
    "wait_state",
    "wait_status",
    "within",
]
