"""``TILERT_MOCK_FAILURE=NAME``: a stand-in prints a known failure's message as the real one does.

One mode per failure signature the agent knows (docs/diagnose.md), each on the program whose log
shows it: the decode (TileRT's format, ``file.py:LINE [LEVEL]: ...`` and Python tracebacks), the
prefill (vLLM's format; the connector's lines prefixed by its engine core process) or the router.
``start`` modes print while the engine loads, then exit (1, or 3 for uvicorn's bind error) as
the real engine does; ``serve`` modes print the line a failing request leaves (a handshake the
prefill refused, a 504 the router logged) just before the stand-in serves, and it keeps serving.
The message text of each is the real one (tilert 0.1.6.post3, vLLM, UCX, NCCL, huggingface_hub;
sources in docs/diagnose.md); paths, pids, ids and sizes are examples.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Literal

FAILURE_ENV = "TILERT_MOCK_FAILURE"
Program = Literal["decode", "prefill", "router"]


@dataclass(frozen=True)
class FailMode:
    """What one failure looks like in its program's log, and whether the program dies of it."""

    program: Program
    when: Literal["start", "serve"]
    text: str
    exit_code: int = 1


_PKG = "/usr/local/lib/python3.12/site-packages/tilert"
_TB = "Traceback (most recent call last):\n"


def _decode_tb(where: str, error: str) -> str:
    return (
        f'{_TB}  File "{_PKG}/pd_vllm/decode_server.py", line 340, in <module>\n    main()\n'
        f'  File "{_PKG}/{where}\n{error}'
    )


def _core(text: str) -> str:
    """Lines of vLLM's engine core process, with the prefix vLLM gives them."""
    return "\n".join(f"(EngineCore_DP0 pid=4242) {line}" for line in text.splitlines())


def _send_failed(error: str) -> str:
    return _core(
        "prefill_connector.py:332 [ERROR]: send failed for 7f3c2a0b9d1e\n"
        f"{_TB}"
        f'  File "{_PKG}/pd_vllm/prefill_connector.py", line 328, in _send_loop\n'
        "    self._send_one(job)\n"
        f'  File "{_PKG}/pd_vllm/prefill_connector.py", line 346, in _handshake\n'
        "    assert ok, msg\n"
        f"{error}"
    )


def _core_dead(error: str) -> str:
    return (
        _core(f"ERROR 12-03 08:00:00 [core.py:708] EngineCore failed to start.\n{_TB}{error}")
        + "\nRuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}"
    )


MODES: dict[str, FailMode] = {
    # ---- the decode (TileRT) ----
    "weights-incomplete": FailMode(
        "decode",
        "start",
        _decode_tb(
            'models/glm_5/generator.py", line 88, in __init__',
            "FileNotFoundError: [Errno 2] No such file or directory: "
            "'/weights/glm5-tilert/chat_template.jinja'",
        ),
    ),
    "torch-build": FailMode(
        "decode",
        "start",
        _decode_tb(
            '__init__.py", line 41, in _check_torch',
            f"RuntimeError: {_PKG}/lib/libtilert_glm5.so was built against torch 2.11.0; "
            "this interpreter has torch 2.10.0+cu129",
        ),
    ),
    "no-nvidia-driver": FailMode(
        "decode",
        "start",
        _decode_tb(
            'models/glm_5/generator.py", line 61, in __init__',
            "RuntimeError: Found no NVIDIA driver on your system. Please check that you have an "
            "NVIDIA GPU and installed a driver from http://www.nvidia.com/Download/index.aspx",
        ),
    ),
    "transport-init": FailMode(
        "decode",
        "start",
        _decode_tb(
            'pd_vllm/transport.py", line 118, in __init__',
            "RuntimeError: Mooncake engine init failed: -1",
        ),
    ),
    "host-buffer": FailMode(
        "decode",
        "start",
        _decode_tb(
            'pd_vllm/transport.py", line 77, in alloc_pinned_huge',
            "RuntimeError: PD host buffer is only 12.0 of 48.0 GiB huge-page backed",
        ),
    ),
    "no-default-route": FailMode(
        "decode",
        "start",
        _decode_tb(
            'pd_vllm/wire.py", line 31, in local_ip',
            "    s.connect((probe, 1))\nOSError: [Errno 101] Network is unreachable",
        ),
    ),
    "nixl-register": FailMode(
        "decode",
        "start",
        _decode_tb(
            'pd_vllm/transport.py", line 201, in register',
            "    self.agent.register_memory(descs)\nnixl._bindings.nixlBackendError: "
            "NIXL_ERR_BACKEND",
        ),
    ),
    "ucx-without-cuda": FailMode(
        "decode",
        "start",
        "[1764748800.123456] [node-1:4242:0]     ucp_context.c:1102 UCX  WARN  transports "
        "'cuda_copy','cuda_ipc' are not available, please use one or more of: posix, self, "
        "sysv, tcp",
    ),
    "ibv-reg-mr": FailMode(
        "decode",
        "start",
        "[node-1:4242:0:4242]        ib_md.c:293  UCX  ERROR ibv_reg_mr(address=0x7f2a00000000, "
        "length=2097152, access=0xf) failed: Bad address",
    ),
    "ucx-gda-cuda": FailMode(
        "decode",
        "start",
        "[1764748800.123456] [node-1:4242:0]        gdaki.c:1021 UCX  ERROR cuDeviceGetCount "
        "failed: initialization error",
    ),
    "ibv-no-device": FailMode(
        "decode",
        "start",
        "[node-1:4242:0:4242]      ib_iface.c:1024 UCX  ERROR ibv_modify_qp(qp=0x5a3, ...) "
        "failed to modify to RTR: No such device",
    ),
    "no-ipv6": FailMode(
        "decode",
        "start",
        _decode_tb(
            'pd_vllm/receive_server.py", line 96, in __init__',
            "    self._sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)\n"
            "OSError: [Errno 97] Address family not supported by protocol",
        ),
    ),
    "prefill-hung-up": FailMode(
        "decode",
        "serve",
        "receive_server.py:259 [ERROR]: connection from ('10.0.0.1', 51234) failed\n"
        f"{_TB}"
        f'  File "{_PKG}/pd_vllm/receive_server.py", line 230, in _handle\n'
        "    msg = recv_msg(conn)\n"
        f'  File "{_PKG}/pd_vllm/wire.py", line 60, in recv_msg\n'
        "    raise ConnectionError('connection closed mid-message')\n"
        "ConnectionError: connection closed mid-message",
    ),
    "decode-slot-taken": FailMode(
        "decode",
        "serve",
        "receive_server.py:199 [WARNING]: rejecting 7f3c2a0b9d1e rank 0 (busy with "
        "91ab44e0c2d7, state=receiving, writers=8)",
    ),
    # ---- the prefill (vLLM with TileRT's connector) ----
    "mla-cache-stride": FailMode(
        "prefill",
        "start",
        _core_dead("AssertionError: unexpected MLA cache stride 1024 B/token"),
    ),
    "mtp-layers": FailMode(
        "prefill", "start", _core_dead("AssertionError: classify: 78 MLA layers (expected 79)")
    ),
    "ki-page-size": FailMode(
        "prefill", "start", _core_dead("AssertionError: KI cache page is 4224 B, expected 8448")
    ),
    "connector-missing": FailMode(
        "prefill", "start", _core_dead("ModuleNotFoundError: No module named 'tilert'")
    ),
    "gpu-memory": FailMode(
        "prefill",
        "start",
        _core_dead(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.49 GiB. GPU 0 has "
            "a total capacity of 79.19 GiB of which 512.00 MiB is free."
        ),
    ),
    "engine-core-died": FailMode(
        "prefill",
        "start",
        "RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}",
    ),
    "hub-offline": FailMode(
        "prefill",
        "start",
        "huggingface_hub.errors.LocalEntryNotFoundError: Cannot find an appropriate cached "
        "snapshot folder for the specified revision on the local disk and outgoing traffic has "
        "been disabled. To enable repo look-ups and downloads online, set 'HF_HUB_OFFLINE=0' as "
        "environment variable.",
    ),
    "nccl-init": FailMode(
        "prefill",
        "start",
        _core_dead(
            "RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for "
            "details)"
        ),
    ),
    "protocol-mismatch": FailMode(
        "prefill",
        "serve",
        _send_failed("AssertionError: control-plane protocol mismatch: decode=2 vs prefill=1"),
    ),
    "bad-hello": FailMode(
        "prefill",
        "serve",
        _send_failed("AssertionError: bad hello: {'magic': 'HTTP/1.1 400 Bad Request'}"),
    ),
    "kv-layout-mismatch": FailMode(
        "prefill", "serve", _send_failed("AssertionError: layout version mismatch: 50 vs 10")
    ),
    "sender-count-mismatch": FailMode(
        "prefill",
        "serve",
        _send_failed(
            "AssertionError: sender-count mismatch: decode expects 8 sender rank(s) but prefill "
            "has 4"
        ),
    ),
    "transport-mismatch": FailMode(
        "prefill",
        "serve",
        _send_failed("AssertionError: transport mismatch: decode=nixl vs prefill=mooncake"),
    ),
    "seq-too-long": FailMode(
        "prefill",
        "serve",
        _send_failed("AssertionError: seq 5000 exceeds decode max_seq_len 4096"),
    ),
    "admission-gave-up": FailMode(
        "prefill",
        "serve",
        _core(
            "prefill_connector.py:475 [WARNING]: gave up admitting 7f3c2a0b9d1e rank=0 after 5 "
            "attempts: its shard was NOT transferred, so the decode node will wait out its "
            "kv_transfer_timeout for this request"
        ),
    ),
    "pipeline-abandoned": FailMode(
        "prefill",
        "serve",
        _core(
            "prefill_connector.py:419 [ERROR]: pipeline: 7f3c2a0b9d1e rank=0 got no layer/end "
            "for 600s; abandoning"
        ),
    ),
    # ---- the router ----
    "kv-transfer-timeout": FailMode(
        "router",
        "serve",
        "pd_router.py:40 [ERROR]: decode node http://10.0.0.2:5557 returned 504 for "
        "7f3c2a0b9d1e: {'error': 'kv_transfer_timeout', 'rid': '7f3c2a0b9d1e'}",
    ),
    "decode-busy": FailMode(
        "router",
        "serve",
        "pd_router.py:38 [WARNING]: decode node http://10.0.0.2:5557 still busy for "
        "7f3c2a0b9d1e after 2 attempts",
    ),
    "unsupported-field": FailMode(
        "router",
        "start",
        f'{_TB}  File "{_PKG}/pd_vllm/pd_router.py", line 640, in main\n'
        "SystemExit: generation_config.json: repetition_penalty=1.05 is not supported by the "
        "TileRT decode stage; cannot serve with these sampling defaults",
    ),
    "no-token-ids": FailMode(
        "router",
        "serve",
        "pd_router.py:398 [ERROR]: pd request failed\n"
        f'{_TB}  File "{_PKG}/pd_vllm/pd_router.py", line 371, in _handle\n'
        "ValueError: cannot extract first token id from logprobs",
    ),
    "address-in-use": FailMode(
        "router",
        "start",
        "ERROR:    [Errno 98] error while attempting to bind on address ('0.0.0.0', 8000): "
        "address already in use",
        exit_code=3,
    ),
}


def print_failure(name: str | None, program: Program, when: Literal["start", "serve"]) -> None:
    """Print failure ``name``'s message if it belongs to ``program`` at ``when``; a ``start``
    failure then ends the process as the real one ends."""
    mode = MODES.get(name or "")
    if mode is None or mode.program != program or mode.when != when:
        return
    logging.getLogger("standin.faults").info("%s: printing failure %s", FAILURE_ENV, name)
    sys.stderr.write(mode.text + "\n")
    sys.stderr.flush()
    if when == "start":
        logging.shutdown()
        os._exit(mode.exit_code)
