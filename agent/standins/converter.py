"""Stand-in for TileRT's weight converter (``python -m tilert.models.preprocess.weight_converter``).

Same flags (``--model_type {glm-5,deepseek-v32} --model_dir HF --save_dir OUT [--test_mode]
[--append_mtp]``), same checks (an unknown model type, a missing model folder or index is a
``ValueError``: traceback, exit 1; the save folder is created), and the same output, written the
same way: shards ``model.safetensors-0000I-of-0000N.safetensors`` one after the other (each first
named ``-of-<tensor count>``, all renamed at the end, as TileRT does), then
``model.safetensors.index.json`` last. ``--append_mtp`` adds ``model_mtp_layer61-00001.safetensors``
to an existing conversion in ``--save_dir`` and rewrites its index in place. Shards are real
safetensors files (8-byte header length, JSON header, data), so the agent's completeness check
reads them as it reads TileRT's. It reads only the checkpoint's index, not its tensors.

Switches (``agent.standins.faults.ConvertFaults``): how much it writes, slow, crash half way,
a small disk that fills (ENOSPC).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from agent.facts import CONVERTER_MODEL_TYPES, WEIGHTS_INDEX_FILE
from agent.standins.faults import ConvertFaults, FaultConfigError, die

log = logging.getLogger("tilert")

MTP_SHARD = "model_mtp_layer61-{:05d}.safetensors"
_CHUNK = 64 * 1024
TENSORS_PER_SHARD = 2


def build_parser() -> argparse.ArgumentParser:
    """The converter's flags (its ``__main__``)."""
    ap = argparse.ArgumentParser(prog="weight_converter")
    ap.add_argument("--model_type", type=str, required=True)
    ap.add_argument("--model_dir", type=str, required=True)
    ap.add_argument("--save_dir", type=str, required=True)
    ap.add_argument("--test_mode", action="store_true", help="Test mode")
    ap.add_argument("--append_mtp", action="store_true", help="Append MTP layer weights")
    return ap


class Disk:
    """The save folder's disk: unlimited, or ``capacity`` bytes (a write past it is ENOSPC)."""

    def __init__(self, capacity: int | None, used: int) -> None:
        self.capacity = capacity
        self.used = used

    def write(self, f: Any, data: bytes) -> None:
        """Write ``data`` to ``f``, as far as the disk allows."""
        if self.capacity is not None and self.used + len(data) > self.capacity:
            room = max(0, self.capacity - self.used)
            f.write(data[:room])
            f.flush()
            self.used += room
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        f.write(data)
        self.used += len(data)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def save_file(tensors: dict[str, int], path: Path, disk: Disk) -> None:
    """A safetensors file of byte tensors of the given sizes (zeros)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, size in tensors.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        disk.write(f, len(text).to_bytes(8, "little") + text)
        left = offset
        while left > 0:
            n = min(_CHUNK, left)
            disk.write(f, bytes(n))
            left -= n


def _check_dirs(model_dir: Path, save_dir: Path) -> None:
    if not model_dir.exists():
        raise ValueError(f"Model directory {model_dir} does not exist")
    if not (model_dir / WEIGHTS_INDEX_FILE).exists():
        raise ValueError(f"Index file {WEIGHTS_INDEX_FILE} not found in {model_dir}")
    save_dir.mkdir(parents=True, exist_ok=True)


def _shard_tensors(layer: int, faults: ConvertFaults) -> dict[str, int]:
    size = max(1, faults.shard_bytes // TENSORS_PER_SHARD)
    return {f"layer_{layer}_weights_{t}_dev_{t}": size for t in range(TENSORS_PER_SHARD)}


def convert(save_dir: Path, faults: ConvertFaults, disk: Disk) -> None:
    """``to_tilert_weights``: every shard, renamed to its final count, then the index."""
    total = faults.shards
    tensor_nums = total * TENSORS_PER_SHARD
    written: list[tuple[Path, dict[str, int]]] = []
    for i in range(1, total + 1):
        if faults.delay_s:
            time.sleep(faults.delay_s)
        log.info("Converting weight layer %d / %d", i, total)
        tensors = _shard_tensors(i, faults)
        path = save_dir / f"model.safetensors-{i:05d}-of-{tensor_nums:05d}.safetensors"
        log.info("Saving shard %d to %s", i, path)
        save_file(tensors, path, disk)
        written.append((path, tensors))
        if faults.crash_after_shards is not None and i >= faults.crash_after_shards:
            die("converter", f"{i} of {total} shards written", faults.exit_code)
    weight_map: dict[str, str] = {}
    for i, (path, tensors) in enumerate(written, 1):
        final = save_dir / f"model.safetensors-{i:05d}-of-{total:05d}.safetensors"
        if final != path:
            os.rename(path, final)
        weight_map.update(dict.fromkeys(tensors, final.name))
    size = sum(sum(t.values()) for _, t in written)
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    with open(save_dir / WEIGHTS_INDEX_FILE, "w") as f:
        json.dump(index, f, indent=2)
    log.info("Saved %d shard(s) with max size 5GB", total)
    log.info("Index file: %s", save_dir / WEIGHTS_INDEX_FILE)


def append_mtp(save_dir: Path, faults: ConvertFaults, disk: Disk) -> None:
    """``append_mtp_weights_to_safetensors``: one MTP shard, the index rewritten in place."""
    index_file = save_dir / WEIGHTS_INDEX_FILE
    if not index_file.exists():
        raise ValueError(f"Existing index file not found: {index_file}")
    index = json.loads(index_file.read_text())
    log.info("Found %d existing shards", len(set(index["weight_map"].values())))
    if faults.delay_s:
        time.sleep(faults.delay_s)
    tensors = {f"layer_61_mtp_{k}": v for k, v in _shard_tensors(61, faults).items()}
    name = MTP_SHARD.format(1)
    log.info("Saving MTP shard to %s", name)
    save_file(tensors, save_dir / name, disk)
    index["weight_map"].update(dict.fromkeys(tensors, name))
    index["metadata"]["total_size"] += sum(tensors.values())
    with open(index_file, "w") as f:
        json.dump(index, f, indent=2)
    log.info("Added 1 new MTP shard(s)")


def main(argv: list[str] | None = None) -> None:
    """Run like ``python -m tilert.models.preprocess.weight_converter``."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr
    )
    args = build_parser().parse_args(argv)
    try:
        faults = ConvertFaults.from_env()
    except FaultConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    if args.model_type not in CONVERTER_MODEL_TYPES.values():
        raise ValueError(f"Invalid model type: {args.model_type}")
    model_dir, save_dir = Path(args.model_dir), Path(args.save_dir)
    _check_dirs(model_dir, save_dir)
    log.info("weight converter stand-in: %s from %s into %s", args.model_type, model_dir, save_dir)
    disk = Disk(faults.disk_bytes, _folder_bytes(save_dir))
    if args.append_mtp:
        append_mtp(save_dir, faults, disk)
    else:
        convert(save_dir, faults, disk)


if __name__ == "__main__":
    main()
