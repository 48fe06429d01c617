"""Stand-in ``tilert`` package: only ``pd_vllm.prefill_connector`` (see ``..``'s docstring)."""
