"""From the user's input to a plan: the recipe and cluster file, checked, resolved, then planned.

- ``model``: the recipe as typed Structs (srtctl schema-2 spellings plus the ``agent:`` section);
- ``typedyaml``: YAML with line numbers, and a walk that reports every unknown key and wrong type;
- ``overrides``: ``--set KEY=VALUE`` and ``--unset KEY``; ``sweep``: srtctl's ``sweep:`` section;
- ``cluster``: the cluster file (srtctl's ``srtslurm.yaml``) and its aliases;
- ``rules``: the load-time rules (srtctl's, the prefill/decode agreements, the weights conversion,
  the benchmark);
- ``submithost``: what only the submit host can check (the cluster's GPU variable, mounts, a
  conversion source it reads);
- ``loader``: all of the above in order, every problem in one ``agent.problems.InputError``;
- ``planner``: a loaded recipe -> the launch plan (``agent.job.plan``); ``convertplan``: its
  weights conversion, and the plan of a ``tilert-submit convert`` job; ``benchplan``: its
  benchmark.

Runs in the submitter, and in every agent when it re-checks ``J/recipe.yaml``. May import
``agent.facts``, ``agent.problems``, ``agent.errors`` and ``agent.job``; nothing of the node, HTTP
or head layers.
"""
