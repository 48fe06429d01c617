"""Stand-in ``tilert.pd_vllm``: the prefill connector only."""
