"""tilert-agent: the node-local supervisor for vLLM prefill + TileRT decode + TileRT's P/D router.

Everything that runs on a node lives here, together with the formats that cross processes and
nodes (recipe model, plan, rendezvous record, status). The submitter (``submit/``) is a thin client
of these formats.
"""

__version__ = "0.1.0"
