"""TileRTConnector for a CPU vLLM: TileRT's control-plane handshake, without KV bytes.

The real connector needs an RDMA transport and a GPU. This one loads through the recipe's
unchanged ``--kv-transfer-config`` (vLLM imports ``kv_connector_module_path`` and takes the class
named ``kv_connector``), keeps vLLM's KV to itself, and when a request that carries
``kv_transfer_params`` finishes, does what the decode waits for: every sender rank's hello,
admission, verdict and done on the ctrl port of the decode those parameters name, with the rid
derived from vLLM's request id. The sending side is the prefill stand-in's own
(``agent.standins.kvlink.Sender``), run on a trio loop in a thread of vLLM's scheduler process.

vLLM builds one instance per process: the API server only imports this module, EngineCore makes
the SCHEDULER instance (the one that sends), each Worker a WORKER instance (no-ops here).
It needs ``trio`` and ``msgspec`` in vLLM's environment (vLLM brings msgspec).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

# The agent's package, for the sending side: found where this file lives when vLLM's
# environment does not have it (appended, so nothing of vLLM's is shadowed).
_AGENT_PARENT = Path(__file__).resolve().parents[5]
if importlib.util.find_spec("agent") is None:
    sys.path.append(str(_AGENT_PARENT))

import trio  # noqa: E402

from agent.standins.kvlink import ConnectorConfig, Sender  # noqa: E402
from agent.standins.openai_api import SAMPLING_KEYS  # noqa: E402

log = logging.getLogger("pd_vllm.connector")


def _log_like_vllm() -> None:
    """The connector's lines in vLLM's log (vLLM configures only its own loggers)."""
    pd_log = logging.getLogger("pd_vllm")
    if not pd_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
        )
        pd_log.addHandler(handler)
        pd_log.setLevel(logging.INFO)
        pd_log.propagate = False


class _SendLoop:
    """A trio loop in a daemon thread running the sender; vLLM's scheduler calls in from its own."""

    def __init__(self, config: ConnectorConfig) -> None:
        self._config = config
        self._ready = threading.Event()
        self._sender: Sender | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        threading.Thread(
            target=trio.run, args=(self._main,), name="tilert-standin-connector", daemon=True
        ).start()
        self._ready.wait()

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self._sender = Sender(self._config, nursery, no_kv=False)
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await trio.sleep_forever()

    def claim(
        self, request_id: str, params: dict[str, Any], seq_len: int, sampling: dict[str, Any]
    ) -> None:
        """Hand one finished request to the sender (its handshakes run in the background)."""
        if self._sender is None or self._token is None:
            raise RuntimeError("the connector's send loop did not start")
        trio.from_thread.run_sync(
            self._sender.claim, request_id, params, seq_len, sampling, trio_token=self._token
        )


# vLLM is not installed where the agent is type-checked: its base class is Any here.
class TileRTConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector API with TileRT's handshake and no KV transfer."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        transfer = vllm_config.kv_transfer_config
        self._config = ConnectorConfig.from_config(
            {
                "kv_connector": transfer.kv_connector,
                "kv_connector_extra_config": dict(transfer.kv_connector_extra_config or {}),
            },
            tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
            kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        )
        self._loop: _SendLoop | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._config.announce()
            log.info("TileRTConnector stand-in: control-plane handshake only, no KV is sent")

    # ---- worker side: vLLM's KV stays where it is ----------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to load: a producer receives no KV."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """No KV leaves this process (TileRT writes it over RDMA between admission and done)."""

    def wait_for_save(self) -> None:
        """Nothing was saved."""

    # ---- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """No external KV cache: every prompt token is computed here."""
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Nothing to track per request before it finishes."""

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """No work for the workers."""
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        """Shake hands with the decode the request names; vLLM frees the blocks at once."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not params.get("tilert_host"):
            return False, None
        sampling_params = request.sampling_params
        log.info(
            "request %s finished: kv_transfer_params=%s max_tokens=%s prompt_tokens=%d",
            request.request_id,
            params,
            getattr(sampling_params, "max_tokens", None),
            request.num_prompt_tokens,
        )
        sampling = {
            key: value
            for key in SAMPLING_KEYS
            if (value := getattr(sampling_params, key, None)) is not None
        }
        if self._loop is None:
            self._loop = _SendLoop(self._config)
        self._loop.claim(request.request_id, params, request.num_prompt_tokens, sampling)
        return False, None
