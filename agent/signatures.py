"""Known failure signatures: a regex on an engine's log lines, its cause and its fix.

Each comes from TileRT 0.1.6.post3, vLLM, NCCL, UCX/NIXL or huggingface_hub as they write their
messages (docs/diagnose.md lists them with their sources). ``where`` names the logs it appears in:
``prefill`` (vLLM, with TileRT's connector), ``decode`` (TileRT's decode server), ``router``.
``fatal`` signatures end an engine's startup wait at once: only exceptions that end a start for
sure, with words no healthy start prints. The others (warnings a start may survive, per-request
failures) name the cause once the engine fails or while it serves. ``generic`` ones say only
that something earlier went wrong: a specific signature of the same log wins over them.

The agent's supervisor matches the lines as its log pump reads them (``Matcher``), and
``tilert-submit diagnose`` reads the log files (``match_line``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

Where = str  # "prefill", "decode" or "router"
# A block larger than this is matched on its last part only (a flood; diagnose reads it all).
SCAN_TAIL_BYTES = 16 * 1024

_KV_BASES = {10: "glm5", 11: "dsv32", 12: "glm5_2", 1010: "glm5 without MTP"}
_KV_EXTRAS = {
    0: "fp8_ds_mla",
    40: "bf16",
    100: "fp8_ds_mla, tiled KI",
    140: "bf16, tiled KI",
    200: "ROCm fp8",
    300: "ROCm fp8, tiled KI",
}


def describe_layout(version: str) -> str:
    """A TileRT KV layout version in words: ``50`` -> ``glm5 bf16 (v50)``.

    version = profile base (glm5 10, dsv32 11, glm5_2 12, glm5 with TILERT_PD_NO_MTP 1010)
    + 40 bf16, + 100 tiled KI, + 200 ROCm fp8 (pd_vllm/profiles/mla_nsa.py ``layout_version``).
    """
    for base, profile in _KV_BASES.items():
        for extra, words in _KV_EXTRAS.items():
            if str(base + extra) == version:
                return f"{profile} {words}, v{version}"
    return f"layout v{version}"


def _layouts(groups: dict[str, str]) -> dict[str, str]:
    return {
        "decode_kv": describe_layout(groups.get("decode") or ""),
        "prefill_kv": describe_layout(groups.get("prefill") or ""),
    }


@dataclass(frozen=True)
class Signature:
    """One known failure: how its log line looks, what it means, how to fix it."""

    name: str
    where: tuple[Where, ...]
    pattern: str
    # Literal pieces, one of which every matching line holds: a cheap test before the regex.
    needles: tuple[str, ...]
    # Plain words with ``{group}`` of the pattern's named groups (and of ``derive``'s).
    cause: str
    fix: str
    fatal: bool = False
    generic: bool = False
    derive: Callable[[dict[str, str]], dict[str, str]] | None = None
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)
    bregex: re.Pattern[bytes] = field(init=False, repr=False, compare=False)
    bneedles: tuple[bytes, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", re.compile(self.pattern))
        object.__setattr__(self, "bregex", re.compile(self.pattern.encode(), re.MULTILINE))
        object.__setattr__(self, "bneedles", tuple(n.encode() for n in self.needles))


@dataclass(frozen=True)
class Finding:
    """A signature matched on one line."""

    signature: Signature
    line: str
    groups: dict[str, str]

    @property
    def cause(self) -> str:
        """The cause with the line's values filled in."""
        sig = self.signature
        values = {k: v for k, v in self.groups.items() if v is not None}
        if sig.derive is not None:
            values.update(sig.derive(values))
        try:
            return sig.cause.format_map(_Missing(values))
        except (ValueError, IndexError):
            return sig.cause

    def reason(self) -> str:
        """One line for an agent's ``reason``: the cause, then the fix."""
        return f"{self.cause}: {self.signature.fix}"


class _Missing(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return "?"


def _sig(
    name: str,
    where: str,
    pattern: str,
    needles: Iterable[str],
    cause: str,
    fix: str,
    **kw: object,
) -> Signature:
    return Signature(
        name=name,
        where=tuple(where.split(",")),
        pattern=pattern,
        needles=tuple(needles),
        cause=cause,
        fix=fix,
        **kw,  # type: ignore[arg-type]
    )


SAME_TILERT = "install the same tilert (0.1.6.post3) in the prefill, decode and router images"
SIGNATURES: tuple[Signature, ...] = (
    _sig(
        "protocol-mismatch",
        "prefill",
        r"control-plane protocol mismatch: decode=(?P<decode>\d+) vs prefill=(?P<prefill>\d+)",
        ["protocol mismatch"],
        "TileRT control protocol {decode} on the decode, {prefill} on the prefill: different "
        "tilert versions per role",
        SAME_TILERT,
    ),
    _sig(
        "bad-hello",
        "prefill",
        r"bad hello: |ConnectionRefusedError",
        ["bad hello", "ConnectionRefusedError"],
        "the prefill's connector reached no TileRT control plane at the decode's ctrl address "
        "(wrong magic, or nothing listening)",
        "check the decode's ctrl port in the router's --decode host:ctrl:http list (the agent "
        "builds it from the decodes' records; a site's router args must not override it)",
    ),
    _sig(
        "kv-layout-mismatch",
        "prefill",
        r"layout version mismatch: (?P<decode>\d+) vs (?P<prefill>\d+)",
        ["layout version mismatch"],
        "KV layout mismatch between prefill ({prefill_kv}) and decode ({decode_kv})",
        "pair the KV dtypes: roles.prefill.args.kv-cache-dtype fp8_ds_mla with "
        "roles.decode.args.kv-cache-dtype fp8 (or fp8_ds_mla), bfloat16/auto with bf16; the same "
        "TILERT_PD_KI_TILED and TILERT_PD_NO_MTP on both roles",
        derive=_layouts,
    ),
    _sig(
        "mla-cache-stride",
        "prefill",
        r"unexpected MLA cache stride (?P<stride>\d+) B/token",
        ["MLA cache stride"],
        "vLLM's KV cache holds {stride} B/token, a layout TileRT does not know (656 fp8_ds_mla, "
        "1152 bf16, 576 ROCm fp8)",
        "set roles.prefill.args.kv-cache-dtype to fp8_ds_mla (or bfloat16 with a bf16 decode)",
        fatal=True,
    ),
    _sig(
        "mtp-layers",
        "prefill",
        r"classify: (?P<found>\d+) MLA layers \(expected (?P<expected>\d+)\)",
        ["MLA layers (expected"],
        "the prefill has {found} MLA layers where TileRT expects {expected}: the MTP layer is "
        "missing on one side",
        'add --speculative-config \'{{"method":"mtp","num_speculative_tokens":1}}\' to '
        "roles.prefill.args, or set TILERT_PD_NO_MTP=1 in both roles' env",
        fatal=True,
    ),
    _sig(
        "ki-page-size",
        "prefill",
        r"KI cache page is (?P<size>\d+) B, expected 8448",
        ["KI cache page is"],
        "vLLM's KI cache page is {size} B: its block size is not 64 tokens",
        "set roles.prefill.args.block-size: 64",
        fatal=True,
    ),
    _sig(
        "sender-count-mismatch",
        "prefill",
        r"sender-count mismatch: decode expects (?P<decode>\d+) sender rank\(s\) but prefill "
        r"has (?P<prefill>\d+)",
        ["sender-count mismatch"],
        "the decode expects {decode} sender ranks, the prefill has {prefill}",
        "set the same TILERT_PD_SENDERS in roles.prefill.env and roles.decode.env",
    ),
    _sig(
        "transport-mismatch",
        "prefill",
        r"transport mismatch: decode=(?P<decode>\w+) vs prefill=(?P<prefill>\w+)",
        ["transport mismatch"],
        "KV transport {decode} on the decode, {prefill} on the prefill",
        "set roles.decode.args.transport and the prefill's kv_connector_extra_config."
        "tilert_transport to the same (both default to mooncake)",
    ),
    _sig(
        "seq-too-long",
        "prefill,decode",
        r"seq (?P<seq>\d+) exceeds decode max_seq_len (?P<max>\d+)|seq_len exceeds max_seq_len",
        ["exceeds decode max_seq_len", "seq_len exceeds max_seq_len"],
        "a prompt of {seq} tokens is longer than the decode's --max-seq-len {max}",
        "raise roles.decode.args.max-seq-len to the prefill's max-model-len (TileRT's default "
        "is 4096), or lower max-model-len",
    ),
    _sig(
        "prefill-hung-up",
        "decode",
        r"ConnectionError: connection closed mid-message",
        ["connection closed mid-message"],
        "the prefill hung up after the decode's hello: one of its handshake checks failed",
        "read the prefill's log: tilert-submit diagnose names the check",
        generic=True,
    ),
    _sig(
        "kv-transfer-timeout",
        "router",
        r"decode node (?P<node>\S+) returned 504 for (?P<rid>\S+)",
        ["returned 504 for"],
        "the KV of {rid} did not fully reach {node} within its timeout (504)",
        "the cause is in the prefill's log (a handshake mismatch, an admission that gave up, a "
        "stalled RDMA transfer, a wrong tilert_host): tilert-submit diagnose shows it",
        generic=True,
    ),
    _sig(
        "decode-slot-taken",
        "prefill,decode",
        r"decode node refused (?P<rid>\S+) rank=(?P<rank>\d+): \{.*'error': "
        r"'(?P<error>busy|cancelling|duplicate_rank)'"
        r"|rejecting (?P<rid2>\S+) rank (?P<rank2>\d+) \(busy with (?P<other>\S+), state="
        r"|refusing (?P<rid3>\S+) rank (?P<rank3>\d+) for now: no consumer is waiting",
        ["decode node refused", "rejecting ", "no consumer is waiting"],
        "the decode's receive slot was held by another request (or the request was abandoned)",
        "one decode serves one request at a time: keep client concurrency at most the number "
        "of decodes, or add decodes",
    ),
    _sig(
        "admission-gave-up",
        "prefill",
        r"gave up admitting (?P<rid>\S+) rank=(?P<rank>\d+)",
        ["gave up admitting"],
        "the prefill gave up admitting {rid} (rank {rank}) to a busy decode: its KV was not "
        "sent and the decode will answer 504",
        "let the decode drain; raise kv_connector_extra_config.tilert_admission_attempts, or "
        "keep concurrency at most the number of decodes",
    ),
    _sig(
        "pipeline-abandoned",
        "prefill",
        r"pipeline: (?P<rid>\S+) rank=(?P<rank>\d+) got no layer/end for (?P<secs>\d+)s; "
        r"abandoning",
        ["; abandoning"],
        "the prefill's pipelined KV send of {rid} (rank {rank}) got no layer from vLLM's forward "
        "pass for {secs} s and gave up: the forward pass stalled or the request was dropped "
        "mid-prefill; its KV was not sent and the decode will answer 504",
        "read the prefill's log before this line (a stalled or preempted forward pass, a CUDA "
        "error); if it recurs under load, set TILERT_PD_PIPELINE=0 in roles.prefill.env (the "
        "whole-request send after the forward pass)",
    ),
    _sig(
        "decode-busy",
        "router",
        r"decode node (?P<node>\S+) still busy for (?P<rid>\S+) after \d+ attempts"
        r"|all decode nodes busy|no decode node free after waiting",
        ["still busy for", "all decode nodes busy", "no decode node free"],
        "every decode was busy (429)",
        "set the router's --queue-timeout (roles.router args), add decodes, or keep client "
        "concurrency at most the number of decodes",
    ),
    _sig(
        "weights-incomplete",
        "decode",
        r"No such file or directory: '(?P<path>[^']*(?:chat_template\.jinja|"
        r"model\.safetensors\.index\.json))'|Model weights directory (?P<dir>\S+) does not exist",
        ["No such file or directory", "does not exist"],
        "the decode's weights folder is incomplete ({what})",
        "convert the weights (roles.decode.convert, docs/weights.md), then copy the tokenizer "
        "files and chat_template.jinja beside the shards",
        fatal=True,
        derive=lambda g: {"what": g.get("path") or f"{g.get('dir', '?')} is missing"},
    ),
    _sig(
        "torch-build",
        "decode",
        r"(?P<lib>\S+\.so) was built against torch (?P<built>[\d.]+); this interpreter has torch "
        r"(?P<have>\S+)|needs a (?P<kind>ROCm|CUDA) build of torch|Backend library not found"
        r"|TileRT backend '(?P<backend>\S+)' already loaded",
        [
            "was built against torch",
            "build of torch",
            "Backend library not found",
            "already loaded",
        ],
        "TileRT's compiled backend does not fit this image's torch",
        "use the image made for the model: glm5 and dsv32 need CUDA torch 2.11, glm52_rocm "
        "ROCm torch 2.12 (roles.decode.image)",
        fatal=True,
    ),
    _sig(
        "no-nvidia-driver",
        "decode,prefill",
        r"Found no NVIDIA driver on your system",
        ["Found no NVIDIA driver"],
        "the container sees no NVIDIA driver",
        "export NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility in the "
        "role's env (the tilert image leaves them unset under enroot)",
        fatal=True,
    ),
    _sig(
        "transport-init",
        "decode,prefill",
        r"Mooncake engine init failed: (?P<code>-?\d+)|Mooncake register failed"
        r"|mooncake write failed|nixl xfer (?:failed|timed out)"
        r"|No module named '(?P<module>(?:nixl|mooncake)[\w.]*)'",
        ["Mooncake", "mooncake", "nixl xfer", "No module named 'nixl", "No module named 'moon"],
        "the KV transport library is missing or its RDMA setup failed",
        "install nixl or mooncake in both images and check the RDMA devices (UCX_NET_DEVICES)",
        fatal=True,
    ),
    _sig(
        "host-buffer",
        "decode,prefill",
        r"PD host buffer is only (?P<got>[\d.]+) of (?P<want>[\d.]+) GiB huge-page backed"
        r"|cudaHostRegister/hipHostRegister failed"
        r"|TILERT_PD_SENDERS>1 and a host-resident staging buffer are mutually exclusive",
        ["huge-page backed", "HostRegister failed", "mutually exclusive"],
        "the host-resident KV buffer (--pd-buffer-device cpu) could not be set up",
        "enable transparent huge pages (/sys/kernel/mm/transparent_hugepage/{{enabled,defrag}}) "
        "and free RAM, and keep TILERT_PD_SENDERS=1 with a host buffer",
        fatal=True,
    ),
    _sig(
        "no-default-route",
        "decode,prefill",
        r"OSError: \[Errno 101\] Network is unreachable",
        ["Network is unreachable"],
        "TileRT found no route to TILERT_PD_PROBE_ADDR to pick its own address",
        "set TILERT_PD_PROBE_ADDR to a peer address on the RDMA network (the agent sets it to "
        "the node's address: check the role's env does not override it)",
    ),
    _sig(
        "unsupported-field",
        "router",
        r"is not supported by the TileRT decode stage|cannot serve with these sampling defaults",
        ["not supported by the TileRT decode", "cannot serve with these sampling defaults"],
        "a request field (or a generation_config.json default) that TileRT's decode ignores",
        "drop the field from requests (min_p, seed unless greedy, n>1, ...), or pass "
        "--generation-config vllm to the router",
    ),
    _sig(
        "no-token-ids",
        "router",
        r"cannot extract first token id from logprobs",
        ["cannot extract first token id"],
        "the prefill answers without token ids, so the router cannot read the first token",
        "add --return-tokens-as-token-ids to the prefill's command (the agent adds it; check "
        "agent.prefill_command)",
    ),
    _sig(
        "nixl-register",
        "decode,prefill",
        r"nixlBackendError: NIXL_ERR_BACKEND",
        ["NIXL_ERR_BACKEND"],
        "UCX could not register GPU memory for NIXL",
        "use a CUDA-enabled UCX/NIXL build and enable GPUDirect RDMA on the nodes",
        fatal=True,
    ),
    _sig(
        "ucx-without-cuda",
        "decode,prefill",
        r"UCX\s+WARN\s+transports? '?cuda_(?:ipc|copy)'?.* not available"
        r"|UCX CUDA support was not found! GPU memory is not supported",
        ["UCX"],
        "UCX was built or loaded without CUDA: GPU memory cannot be sent",
        "use a CUDA-enabled UCX/NIXL build (the image's nixl-cu* wheel)",
    ),
    _sig(
        "ibv-reg-mr",
        "decode,prefill",
        # UCX prints the call's arguments: ibv_reg_mr(address=..., access=0xf) failed: ...
        r"ibv_reg_(?:dmabuf_)?mr\S*(?:\(.*\))? failed.*Bad address",
        ["ibv_reg_mr"],
        "the NIC cannot register GPU memory (no nvidia_peermem, no DMA-BUF path)",
        "modprobe nvidia_peermem on the nodes, or use a DMA-BUF capable UCX",
    ),
    _sig(
        "ucx-gda-cuda",
        "decode,prefill",
        r"gdaki\.c:\d+\s+UCX\s+ERROR cuDeviceGetCount",
        ["gdaki.c"],
        "UCX's GPU-direct-async transport failed to initialise CUDA",
        "fix CUDA in the container, or leave the rc_gda transport out of UCX_TLS",
    ),
    _sig(
        "ibv-no-device",
        "decode,prefill",
        r"ibv_modify_qp\(.*\) failed to modify to RTR: No such device",
        ["ibv_modify_qp"],
        "UCX picked a wrong or absent HCA",
        "set UCX_NET_DEVICES to the RDMA NICs (e.g. mlx5_0:1,...,mlx5_7:1) in both roles' env",
    ),
    _sig(
        "connector-missing",
        "prefill",
        r"No module named 'tilert'|Unsupported connector type: TileRTConnector"
        r"|cannot import name 'SupportsHMA'",
        ["No module named 'tilert'", "Unsupported connector type", "SupportsHMA"],
        "vLLM cannot load TileRT's connector",
        "pip install tilert --no-deps in the prefill image, keep kv_connector_module_path "
        "tilert.pd_vllm.prefill_connector, and use a vLLM with SupportsHMA",
        fatal=True,
    ),
    _sig(
        "gpu-memory",
        "prefill",
        r"torch\.OutOfMemoryError: CUDA out of memory|No available memory for the cache blocks"
        r"|KV [Cc]ache is needed, which is larger than the available KV [Cc]ache memory"
        r"|Free memory on device .* is less than desired GPU memory utilization",
        [
            "OutOfMemoryError",
            "No available memory for the cache",
            "larger than the available",
            "is less than desired GPU memory",
        ],
        "the model, its KV cache and TileRT's staging buffer do not fit in GPU memory",
        "lower roles.prefill.args.gpu-memory-utilization (0.5-0.8) or max-model-len",
        fatal=True,
    ),
    _sig(
        "engine-core-died",
        "prefill",
        r"EngineDeadError: EngineCore encountered an issue"
        r"|Engine core initialization failed\. See root cause above",
        ["EngineDeadError", "Engine core initialization failed"],
        "vLLM's engine core died",
        "the root cause is the traceback above this line in the prefill's log",
        fatal=True,
        generic=True,
    ),
    _sig(
        "address-in-use",
        "prefill,decode,router",
        r"\[Errno 98\] (?:[Aa]ddress already in use|error while attempting to bind on address "
        r".*: address already in use)",
        ["Errno 98"],
        "a port the engine binds is taken",
        "the agent moves an engine that never served to new ports; otherwise stop the stale "
        "server holding it",
    ),
    _sig(
        "hub-offline",
        "prefill,router,decode",
        r"LocalEntryNotFoundError: Cannot find (?:the requested files in the disk cache"
        r"|an appropriate cached snapshot folder)|offline mode is enabled"
        r"|We couldn't connect to 'https://huggingface\.co'"
        r"|is not a local folder and is not a valid model identifier",
        [
            "LocalEntryNotFoundError",
            "offline mode is enabled",
            "couldn't connect to 'https://hug",
            "is not a local folder",
        ],
        "a model was named by hub id, and it is neither cached nor downloadable here",
        "download it beforehand and use local paths (model.path), or share HF_HOME with its cache",
    ),
    _sig(
        "nccl-init",
        "prefill",
        r"NCCL error: unhandled (?:system|cuda) error|NET/IB : GPU Direct RDMA Disabled for HCA",
        ["NCCL error", "GPU Direct RDMA Disabled"],
        "NCCL could not initialise (IPC_LOCK missing, /dev/shm not mounted, or GPUDirect RDMA "
        "disabled on the HCA)",
        "give the container IPC_LOCK and /dev/shm, and run with NCCL_DEBUG=INFO to see which",
    ),
    _sig(
        "no-ipv6",
        "decode",
        r"OSError: \[Errno 97\] Address family not supported by protocol",
        ["Errno 97"],
        "the kernel has no IPv6: TileRT's decode binds its ports on '::'",
        "enable IPv6 on the node",
        fatal=True,
    ),
)
BY_NAME = {sig.name: sig for sig in SIGNATURES}

# The agent's own notes in an engine's log that name a cause (docs/diagnose.md, "The agent's own
# notes"): matched by ``tilert-submit diagnose`` only (the agent wrote them knowing the cause).
STARVED_NOTE = "=== router starved"
NOTES: tuple[Signature, ...] = (
    _sig(
        "router-starved",
        "router",
        r"^=== router starved\b",
        [STARVED_NOTE],
        "the router was alive but too busy to answer /health: every one of its 40 threads was "
        "taken by requests waiting for a free decode or for the prefill (the head did not count "
        "it as a failure, up to a bound)",
        "send clients to the front door (front_url), which sends no more requests than there are "
        "decodes; add decodes (tilert-submit scale); keep the router's --queue-timeout short",
    ),
)


@dataclass(frozen=True)
class SignatureSet:
    """The signatures of one log, with one regex of all their needles (built once)."""

    items: tuple[Signature, ...]
    needles: re.Pattern[bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        words = sorted({n for sig in self.items for n in sig.bneedles})
        object.__setattr__(self, "needles", re.compile(b"|".join(re.escape(n) for n in words)))

    def may_match(self, block: bytes) -> bool:
        """Whether any needle is in ``block`` (cheap: no signature regex runs)."""
        if len(block) < _ONE_REGEX_BELOW:
            return self.needles.search(block) is not None
        return any(n in block for sig in self.items for n in sig.bneedles)


# Blocks shorter than this are tested for every needle at once with one regex (one call into C
# beats a loop of ``in`` on a short block; on a long one the loop wins).
_ONE_REGEX_BELOW = 4096


@functools.cache
def for_role(where: Where) -> SignatureSet:
    """The signatures that appear in ``where``'s log."""
    return SignatureSet(tuple(sig for sig in SIGNATURES if where in sig.where))


def match_line(line: str, signatures: SignatureSet) -> Finding | None:
    """The first signature ``line`` shows, or None."""
    for sig in signatures.items:
        if any(n in line for n in sig.needles):
            m = sig.regex.search(line)
            if m:
                return Finding(sig, line.rstrip("\r\n"), m.groupdict())
    return None


def match_block(
    block: bytes, signatures: SignatureSet, *, whole: bool = False
) -> Iterator[tuple[int, Finding]]:
    """``(offset of the line, finding)`` for each signature shown in a block of whole lines, in
    the order of their lines; of a block over ``SCAN_TAIL_BYTES`` only its last part (a flood
    read at once) unless ``whole``."""
    start = 0
    if not whole and len(block) > SCAN_TAIL_BYTES:
        start = block.find(b"\n", len(block) - SCAN_TAIL_BYTES) + 1
    view = block[start:] if start else block
    if not signatures.may_match(view):
        return iter(())
    found: list[tuple[int, Finding]] = []
    for sig in signatures.items:
        if not any(n in view for n in sig.bneedles):
            continue
        for m in sig.bregex.finditer(view):
            first = view.rfind(b"\n", 0, m.start()) + 1
            end = view.find(b"\n", m.end())
            line = view[first : end if end >= 0 else len(view)].decode("utf-8", "replace")
            groups = {k: v.decode("utf-8", "replace") for k, v in m.groupdict().items() if v}
            found.append((start + first, Finding(sig, line.rstrip("\r"), groups)))
    found.sort(key=lambda item: item[0])
    return iter(found)


def best(findings: Iterable[Finding]) -> Finding | None:
    """The finding that explains most: the last specific one, else the last generic one."""
    chosen: Finding | None = None
    for f in findings:
        if chosen is None or not f.signature.generic or chosen.signature.generic:
            chosen = f
    return chosen
