"""The local backend: ``--local`` runs a job's agents as processes on this machine (``run``, the
foreground supervisor) and the ``Backend`` that starts, watches and stops it (``backend``);
``timelimit``: ``slurm.time_limit`` as Slurm applies it (TERM at the signal lead, the end at the
limit).

May import ``agent.problems``, ``agent.errors``, ``agent.job``, ``agent.launch`` and ``agent.node``
(the agents' own process launcher and log sink), ``agent.recipe.serviceplan`` (Slurm's time
format), and ``submit.backend`` for the interface; never ``submit.slurm`` nor the commands.
``backend`` never imports ``run`` (nor trio): to run a job the submitter execs ``python -m
submit.local.run J``, which becomes the supervisor.
"""
