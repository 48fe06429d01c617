"""TileRT's log lines as its decode server writes them: ``file.py:LINE [LEVEL]: message``.

Importing ``tilert`` runs ``logging.basicConfig(format='%(filename)s:%(lineno)d [%(levelname)s]:
%(message)s')`` to stderr: no timestamp, no logger name. The stand-in's loggers carry TileRT's
logger names; this formatter prints the TileRT file each name stands for, and for every message
TileRT 0.1.6.post3 has, its line there (so ``REQSTAT`` reads ``decode_server.py:106 [INFO]:
REQSTAT rid=...``, exactly as the real decode writes it). Messages of the stand-in's own keep
its line numbers.
"""

from __future__ import annotations

import logging

FORMAT = "%(filename)s:%(lineno)d [%(levelname)s]: %(message)s"
FILES = {
    "pd_vllm.decode_server": "decode_server.py",
    "pd_vllm.receive": "receive_server.py",
    "pd_vllm.connector": "prefill_connector.py",
}
_NO_CONSUMER = "refusing %s rank %d for now: no consumer is waiting for this request"
# (file, message format) -> line, read from the tilert 0.1.6.post3 wheel (tilert/pd_vllm/).
LINES = {
    ("decode_server.py", "cancel requested for %s"): 64,
    ("decode_server.py", "dropping unmatched request %s (waiting for %s)"): 93,
    ("decode_server.py", "REQSTAT rid=%s seq=%d completion=%d %s"): 106,
    ("decode_server.py", "logprobs requested but unsupported by %s (rid=%s)"): 118,
    ("decode_server.py", "sampling rejected for %s: %s (%s)"): 124,
    ("decode_server.py", "cancelled during KV transfer for %s"): 140,
    ("decode_server.py", "prepare failed for %s"): 152,
    ("decode_server.py", "decode failed for %s"): 190,
    ("decode_server.py", "profile %s MLA cache dtype = %s (layout v%d)"): 323,
    ("decode_server.py", "loading TileRT engine (profile=%s, weights=%s)..."): 330,
    ("decode_server.py", "TileRT engine ready (cache window %d, num_mtp %d)"): 332,
    ("decode_server.py", "decode server on :%d (profile=%s, engine=%s, ctrl=:%d)"): 335,
    ("receive_server.py", "control plane listening on :%d"): 101,
    ("receive_server.py", _NO_CONSUMER): 190,
    ("receive_server.py", "request %s: seq_len=%d (generation %d)"): 203,
    ("receive_server.py", "request %s drained; receive slot free"): 218,
    ("receive_server.py", "rank %d sent non-done message: %s"): 241,
    ("receive_server.py", "ignoring done from %s rank %d: request was abandoned"): 249,
    ("receive_server.py", "request %s: rank %d done (%d/%d)"): 252,
    ("receive_server.py", "request %s: all ranks done in %.1f ms"): 257,
    ("receive_server.py", "connection from %s failed"): 259,
}


class TileRTFormatter(logging.Formatter):
    """TileRT's format, with the file and line of the TileRT message a record stands for."""

    def __init__(self) -> None:
        super().__init__(FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        """The record as TileRT prints it."""
        file = FILES.get(record.name)
        if file is not None:
            record.filename = file
            record.lineno = LINES.get((file, str(record.msg)), record.lineno)
        return super().format(record)
