"""The TileRT connector stand-in for a real (CPU) vLLM: a folder to put on vLLM's import path.

It holds ``tilert/pd_vllm/prefill_connector.py``, so the unchanged ``--kv-transfer-config`` of a
recipe (``TileRTConnector`` from ``tilert.pd_vllm.prefill_connector``) loads our connector in
every vLLM process. The agent prepends ``CONNECTOR_PATH`` to the prefill's PYTHONPATH only when
asked (``TILERT_STANDIN_CONNECTOR=1`` with stand-in decodes) and only when the engine's
interpreter has no real ``tilert`` (docs/standins.md, "The connector stand-in").
"""

from pathlib import Path

CONNECTOR_PATH = Path(__file__).resolve().parent
# The switch, in the prefill's environment (recipe roles.prefill.env or the agent's own).
SWITCH = "TILERT_STANDIN_CONNECTOR"
