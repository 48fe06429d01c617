"""Stand-ins for the GPU engines: vLLM prefill with TileRT's connector, TileRT decode and router.

Product code: ``tilert-submit --mock`` and the local demo run them, and tests drive the real TileRT
router against them. Each speaks its engine's HTTP and control-port protocols and takes its argument
list (unknown flags are accepted and logged). ``python -m agent.standins.prefill serve MODEL ...``,
``python -m agent.standins.decode ...``, ``python -m agent.standins.router ...``; fault switches in
``agent.standins.faults``; docs/standins.md describes them.
"""
