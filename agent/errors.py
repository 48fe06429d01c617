r"""The project's errors, in one tree, and the exit codes of both command lines.

Every error of ``agent`` and ``submit`` is a ``TilertError``, on one of two branches: bad input
(the user can fix it: a recipe key, a flag, a file; exit 2) or a runtime failure (something went
wrong while running; exit 1). The command lines (``tilert-submit``, ``tilert-agent``) print
``str(error)`` and exit with its branch's code, never with a traceback::

    TilertError
    ├── BadInput                  exit 2: the message names the key, flag or file, and the fix
    │   ├── InputError            agent.problems: every problem of a recipe, cluster file, flag
    │   ├── YamlSyntaxError       agent.recipe.typedyaml: a file that is not YAML
    │   ├── IdentityError         agent.node.identity: the environment does not say who we are
    │   ├── SelectionError        submit.logview.catalogue: ``logs J NAME`` names no log
    │   ├── BenchFlagsError       submit.bench: a ``bench`` flag out of the recipe's rules
    │   ├── PoolFileError         agent.job.pool: ``J/pool.json`` cannot be used
    │   ├── BodyError             agent.front.answers: a request body a front refuses (413/408/400)
    │   └── FaultConfigError      agent.standins.faults: a stand-in's fault switch is malformed
    ├── RuntimeFailure            exit 1: what failed, where, and what to do next
    │   ├── JobFailed             agent.head.decisions: the job can no longer serve
    │   ├── CanaryFailed          agent.head.canaries: a canary through the router failed
    │   ├── Inconclusive          agent.head.verify: a decode's answers could not be checked
    │   ├── WeightsError          agent.node.conversion: the weights folder cannot be served
    │   ├── LockLost              agent.node.folderlock: the weights folder's lock was taken
    │   ├── HubCacheError         agent.node.hubcache: a hub id's snapshot is not in the cache
    │   ├── RecordProblem         agent.node.rendezvous: a rendezvous file that is no record
    │   ├── UpstreamError         agent.http.upstream: vLLM's /metrics answer is unusable
    │   ├── PollFailed            agent.http.longpoll: a peer's long poll got no usable answer
    │   ├── Unavailable           agent.front.proxy: no router takes a request in time (503)
    │   ├── QueueRefused          agent.front.admission: past the queue bounds (429; 503: no decode)
    │   ├── PageError             agent.http.reexport: vLLM's /metrics page does not parse
    │   ├── RunTimeout            agent.launch.spec: a one-shot process ran past its bound
    │   ├── ResultsError          agent.benchmark.results: a level's export is unreadable
    │   ├── PlotsUnavailable      agent.benchmark.plots: no matplotlib for the charts
    │   ├── WireError             agent.standins.wire: the KV link's stand-in protocol broke
    │   ├── BackendError          submit.backend: Slurm or the local supervisor refused
    │   ├── PoolBusy              submit.poollock: another ``scale`` holds ``J/pool.lock``
    │   ├── SlurmError            submit.slurm.client: a Slurm command failed
    │   ├── NoLogYet              submit.logview.remote: the log's agent has not started
    │   └── Unreachable           submit.logview.remote: the log's agent cannot be asked
    └── HTTPError                 agent.web.asgi: one request's answer (its status), no exit

Most of them never reach a command line: the agent turns a failure into a state (``failed``,
``unreachable``, a dropped decode) and the job degrades instead of dying; the tree says what
each would mean if it did. Subclasses keep a standard base where callers rely on it
(``PageError`` and ``PoolFileError`` are each a ``ValueError``, ``RunTimeout`` a
``TimeoutError``).
"""

from __future__ import annotations

# The exit codes of tilert-submit and tilert-agent (docs/cli.md, docs/agent.md): one home.
EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2


class TilertError(Exception):
    """Any error of tilert-agent; ``str()`` is the message a person reads."""

    exit_code = EXIT_RUNTIME


class BadInput(TilertError):
    """The user's input is wrong (recipe, cluster file, flag, job directory): exit 2."""

    exit_code = EXIT_BAD_INPUT


class RuntimeFailure(TilertError):
    """Something failed while running (a process, a node, Slurm, a file system): exit 1."""

    exit_code = EXIT_RUNTIME
