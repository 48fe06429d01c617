"""What TileRT 0.1.6 and vLLM are, as far as this project needs to know: one home for each fact.

Module names, the programs the agent starts, the defaults and choices of TileRT's decode server and
router, the KV layouts each side derives, and the flags the agent manages. The rules, the command
builders, the preflight and the stand-ins all read them here. Imports nothing of ours.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# Modules of the tilert wheel the agent starts or checks for.
CONNECTOR_MODULE = "tilert.pd_vllm.prefill_connector"
DECODE_MODULE = "tilert.pd_vllm.decode_server"
ROUTER_MODULE = "tilert.pd_vllm.pd_router"
# The TileRT connector stand-in (agent.standins.vllm_connector): the folder the agent puts on a
# real vLLM's PYTHONPATH, and the prefill environment switch that asks for it. Named here, not
# imported from the stand-in, so the launch layer never imports a stand-in (docs/ARCHITECTURE.md).
STANDIN_CONNECTOR_PATH = Path(__file__).resolve().parent / "standins" / "vllm_connector"
STANDIN_CONNECTOR_SWITCH = "TILERT_STANDIN_CONNECTOR"
# The program that serves the prefill (``vllm serve MODEL``): ``agent.prefill_command``'s default.
PREFILL_PROGRAM = ("vllm", "serve")
# The interpreters of the decode server and the router (``agent.decode_python``, ``router_python``).
DECODE_PYTHON = "python"
ROUTER_PYTHON = "python"
# Python modules each role's real engine needs (checked by the preflight on the node).
ENGINE_MODULES = {
    "prefill": ("vllm", CONNECTOR_MODULE),
    "decode": (DECODE_MODULE,),
    "router": (ROUTER_MODULE,),
}
# TileRT's weight converter (``python -m MODULE --model_type T --model_dir HF --save_dir OUT
# [--append_mtp]``): it reads a Hugging Face checkpoint and writes the shards the decode server
# loads (``--model-weights-dir``), listed in ``WEIGHTS_INDEX_FILE``, the index written last.
CONVERTER_MODULE = "tilert.models.preprocess.weight_converter"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# What the converter reads from a checkpoint folder before its shards.
CONVERTER_INPUTS = ("config.json", WEIGHTS_INDEX_FILE)
# The converter's --model_type for each decode model profile (its ``__main__`` accepts these two).
# glm5_2 (GLM-5.2/5.3, ROCm) has a converter of its own with other flags
# (tilert.models.glm_5_2_rocm.weight_converter), which the agent does not drive.
CONVERTER_MODEL_TYPES = {"glm5": "glm-5", "dsv32": "deepseek-v32"}
# Distributions whose versions the preflight reports (the tilert versions must match across nodes).
ENGINE_DISTRIBUTIONS = ("tilert", "vllm")

# GPU selection: NVIDIA's variable (srtctl's default), and what ROCm reads on AMD GPUs, whose
# resources.gpu_type names start with "mi" and a digit (mi300x, mi325x, mi355x).
NVIDIA_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
ROCM_DEVICES_ENVS = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def is_amd_gpu(gpu_type: str) -> bool:
    """Whether a ``gpu_type`` names an AMD Instinct GPU (mi300x, MI355X, amd-mi325x)."""
    name = gpu_type.strip().lower().removeprefix("amd").lstrip("-_ ")
    return len(name) > 2 and name.startswith("mi") and name[2].isdigit()


ROUTER_TYPE = "tilert-router"
PREFILL_ENGINE = "vllm"
DECODE_ENGINE = "tilert"

CONNECTOR = "TileRTConnector"
CONNECTOR_ROLE = "kv_producer"

# TileRT 0.1.6 decode_server defaults (the prefill connector has the same transport default).
DEFAULT_TRANSPORT = "mooncake"
TRANSPORTS = ("mooncake", "nixl")
DEFAULT_DECODE_MAX_SEQ_LEN = 4096
DEFAULT_TILERT_MODEL = "glm5"
TILERT_MODELS = ("glm5", "glm5_2", "dsv32")
NUM_MTP_CHOICES = (3,)
DEFAULT_SENDERS = 8
ROUTER_PARSERS = ("glm47", "none")

PREFILL_KV_DEFAULT = "auto"
DECODE_KV_DEFAULT = "fp8_ds_mla"
# KV cache dtype -> layout family, per side. TileRT 0.1.6 derives its layout version on the
# prefill from vLLM's real KV cache and on the decode from --kv-cache-dtype; both must land on the
# same layout:
#
#   vLLM prefill kv-cache-dtype            TileRT decode kv-cache-dtype              layout
#   fp8_ds_mla                             fp8_ds_mla (decode default), fp8,         fp8 MLA
#                                          fp8_e4m3
#   auto (vLLM default), bfloat16, bf16    bf16, bfloat16, auto                      bf16 (+40)
#   fp8, fp8_e4m3 (ROCm)                   fp8_rocm                                  ROCm fp8
#
# vLLM's fp8 on NVIDIA is not the fp8_ds_mla layout.
PREFILL_KV_LAYOUT = {
    "fp8_ds_mla": "fp8 MLA",
    "auto": "bf16",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "fp8": "ROCm fp8",
    "fp8_e4m3": "ROCm fp8",
}
DECODE_KV_LAYOUT = {
    "fp8_ds_mla": "fp8 MLA",
    "fp8": "fp8 MLA",
    "fp8_e4m3": "fp8 MLA",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "auto": "bf16",
    "fp8_rocm": "ROCm fp8",
}
# Decode dtype to suggest for each prefill layout.
DECODE_FOR_LAYOUT = {"fp8 MLA": "fp8", "bf16": "bf16", "ROCm fp8": "fp8_rocm"}

# Args the agent owns: (role, canonical key) -> why and what to do instead.
MANAGED_ARGS = {
    ("decode", "engine"): (
        "the agent always passes --engine tilert (TileRT's default 'stub' is a fake engine)",
        "remove it",
    ),
    ("decode", "http-port"): (
        "the agent chooses the decode HTTP port on its node and passes --http-port",
        "remove it; probing starts at agent.ports.decode.http",
    ),
    ("decode", "ctrl-port"): (
        "the agent chooses the decode control port on its node and passes --ctrl-port",
        "remove it; probing starts at agent.ports.decode.ctrl",
    ),
    ("prefill", "host"): (
        "the agent passes --host: vLLM listens on the node's address, the one peers are told",
        "remove it (the cluster file's network_interface chooses the node's address)",
    ),
    ("prefill", "port"): (
        "the agent chooses the prefill HTTP port on its node and passes --port",
        "remove it; probing starts at agent.ports.prefill.http",
    ),
    ("prefill", "model"): (
        "vLLM serves model.path (the agent passes it as `vllm serve MODEL`)",
        "remove it and set model.path",
    ),
}
ROUTER_MANAGED_ARGS = {
    "vllm-url": "the agent passes the prefill's URL once its port is known",
    "decode": "the agent passes every decode node's host:ctrl:http once their ports are known",
    "host": "the agent passes --host: the router listens on the node's address",
    "port": "the router port is agent.router_port",
}


_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kmgKMG]?)$")


def strict_int(value: Any) -> int | None:
    """An int, or a string of digits, as an int; None for anything else (booleans included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def human_int(value: Any) -> int | None:
    """vLLM's human-readable integers: 1k = 1000, 1K = 1024 (also m/M, g/G); plain ints as is."""
    plain = strict_int(value)
    if plain is not None or not isinstance(value, str):
        return plain
    match = _HUMAN_INT.match(value.strip())
    if not match:
        return None
    number, suffix = match.groups()
    if not suffix:
        return None
    power = "kmg".index(suffix.lower()) + 1
    base = 1000 if suffix.islower() else 1024
    if suffix.isupper() and "." in number:
        return None
    return int(float(number) * base**power)


def human_bytes(value: float) -> str:
    """A byte count for people: ``512 B``, ``1.5 KiB``, ``12.3 GiB`` (binary units)."""
    size = float(value)
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"


def derive_rid(request_id: str) -> str:
    """The rid prefill and decode both derive from a vLLM request id: the router's from the
    prefill's reply id, the connector's from vLLM's request id (``tilert.pd_vllm.wire``)."""
    rid = request_id
    for prefix in ("chatcmpl-", "cmpl-"):
        if rid.startswith(prefix):
            rid = rid[len(prefix) :]
            break
    head, sep, tail = rid.rpartition("-")
    if sep and len(tail) <= 8 and all(c in "0123456789abcdef" for c in tail):
        rid = head
    head, sep, tail = rid.rpartition("-")
    if sep and tail.isdigit() and len(tail) <= 3:
        rid = head
    return rid
