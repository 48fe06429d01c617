"""From the user's recipe to a plan: the layer the submitter runs before anything is submitted.

``model`` holds the recipe's msgspec Structs (srtctl schema 2 plus our ``agent:`` section);
``typedyaml`` parses YAML and checks every key and type at once; ``loader`` turns a file (and
``--set`` overrides from ``overrides``) into a validated recipe; ``cluster`` reads the cluster
file; ``rules`` are the load-time checks; ``planner`` turns recipe + cluster into a ``Plan``.
Every agent runs the same validation again on its node.

May import: the standard library, msgspec, PyYAML, ``agent.facts``, ``agent.problems`` and
``agent.job``. Never the node runtime, the launchers or anything that needs trio.
"""
