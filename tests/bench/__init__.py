"""``python -m tests.bench``: how close each path is to its limit, measured side by side.

Run on demand from the repository root, never as part of the test suite (it takes minutes and
wants the machine to itself; ``--quick`` runs each benchmark fewer times, ``--only NAME,...``
picks some). It prints a table and writes ``bench-results.json``: for each figure of issue 12
(``FIGURES``) its runs (min / median / max), the reference measured beside it in the same run, the
target and whether it is met. Method and figures: docs/performance.md.

- ``results``: a ``Figure`` (runs, reference, target), the table and the JSON file;
- ``cli``: ``tilert-submit --help``, ``status J``, ``--dry-run`` with 64 decodes, beside a bare
  interpreter start;
- ``bringup``: local bring-ups (the gate users wait for, start -> ready, healing), beside the same
  job with srtctl's 5 s polling;
- ``idle``: an idle ready job's head and decode agent (CPU, memory), beside a bare trio process;
- ``reexport``: the prefill agent's ``/metrics`` for a 5,000-line vLLM page, beside the raw page;
- ``logpump``: an engine's 64 KiB writes through the agent, beside straight to a file;
- ``follow``: the head following 1,024 peers, beside a plain client's 1,024 requests;
- ``fakes``: what the benchmarks stand up (a vLLM-like page server, many peers in one process, the
  prefill agent's metrics endpoint, the log pump alone).
"""
