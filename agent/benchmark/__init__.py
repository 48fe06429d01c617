"""The benchmark: a client run against a ready job's router, its results, plots and verdict.

Independent of the recipe: it runs from a ``BenchmarkPlan`` (``agent.job.benchmark``) and a
``BenchTarget`` (the running job as the client sees it), so the head runs it once the job is
``ready`` and ``tilert-submit bench`` runs the same thing from wherever it is.

- ``target``: ``BenchTarget`` and the environment a custom command gets;
- ``aiperf``: AIPerf's command line for one level;
- ``results``: AIPerf's ``profile_export_aiperf.json`` -> a ``LevelResult``;
- ``verdict``: why a level failed (0 output tokens, too many errors, the client's exit status);
- ``summary``: ``summary.json`` and the readable table;
- ``plots``: the PNG charts (matplotlib, the optional ``plots`` extra);
- ``runner``: ``BenchmarkRun``, one level after the other through a launcher, stoppable.

May import ``agent.facts``, ``agent.problems``, ``agent.errors``, ``agent.job``, ``agent.launch``
and ``agent.node`` (the log sink); imported by the head and by ``submit``.
"""
