"""The Slurm backend: the batch script (``render``), the client commands sbatch, scancel and squeue
(``client``) and the ``Backend`` over them (``backend``).

May import ``agent.problems``, ``agent.errors``, ``agent.job`` and ``agent.recipe`` (the cluster
file), and ``submit.backend`` (the interface) and ``submit.PROG``; never ``submit.local`` nor the
commands (``submit.cli``, ``stop``, ``statusview``, ...), which reach it through ``submit.backend``.
"""
