"""The TileRT connector stand-in for a real (CPU) vLLM: a folder to put on vLLM's import path.

It holds ``tilert/pd_vllm/prefill_connector.py``, so the unchanged ``--kv-transfer-config`` of a
recipe (``TileRTConnector`` from ``tilert.pd_vllm.prefill_connector``) loads our connector in
every vLLM process. The agent prepends this folder (``agent.facts.STANDIN_CONNECTOR_PATH``) to
the prefill's PYTHONPATH only when asked (``TILERT_STANDIN_CONNECTOR=1``, the switch
``agent.facts.STANDIN_CONNECTOR_SWITCH``, with stand-in decodes) and only when the engine's
interpreter has no real ``tilert`` (docs/standins.md, "The connector stand-in").
"""
