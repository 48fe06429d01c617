"""The token ids the stand-in engines emit, and their text without a tokenizer.

The demo tokenizer (``recipes/local-demo-model``, built by ``tests/infra/tokenizer.py``) is a
byte-level BPE whose vocabulary starts with ``SPECIAL_TOKENS`` and then the 256 byte symbols in
sorted order (what ``tokenizers``' BPE trainer does with the ByteLevel alphabet). So the id of a
single byte is known without loading the tokenizer, whatever merges training produced: the
stand-ins emit ASCII text byte by byte, and any real tokenizer built that way decodes it.
"""

from __future__ import annotations

import json
from functools import cache

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = SPECIAL_TOKENS
EOS_ID = SPECIAL_TOKENS.index(EOS_TOKEN)

# The prefill's "first token" and the decode's continuation: together a short visible reply.
FIRST_TOKEN_TEXT = "H"
CONTINUATION_TEXT = "ello from the TileRT decode stand-in."


@cache
def byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable unicode symbol table (what ByteLevel pre-tokenization uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@cache
def _byte_ids() -> dict[int, int]:
    ordered = sorted(byte_symbols().values())
    rank = {symbol: i for i, symbol in enumerate(ordered)}
    return {b: len(SPECIAL_TOKENS) + rank[s] for b, s in byte_symbols().items()}


@cache
def _id_bytes() -> dict[int, int]:
    return {i: b for b, i in _byte_ids().items()}


def byte_token_id(byte: int) -> int:
    """The token id of one byte in the demo tokenizer."""
    return _byte_ids()[byte]


def encode_bytes(text: str) -> list[int]:
    """``text`` as one token id per UTF-8 byte."""
    return [byte_token_id(b) for b in text.encode()]


def first_token_id() -> int:
    """The token the prefill stand-in answers with (``max_tokens=1``)."""
    return byte_token_id(ord(FIRST_TOKEN_TEXT))


def continuation_ids() -> list[int]:
    """What the decode stand-in emits after the first token, ending with EOS."""
    return [*encode_bytes(CONTINUATION_TEXT), EOS_ID]


# The stand-in model's reply: ``FIRST_TOKEN_TEXT + CONTINUATION_TEXT`` one byte per token, then
# EOS; with ``ignore_eos`` the continuation repeats instead. A context whose last assistant turn
# already holds the start of that reply (a continued answer: ``continue_final_message``) is
# continued from there, so a reply continued after a cut equals the uncut one.
ASSISTANT_TURN = "<|im_start|>assistant\n"


def _reply_token(at: int, ignore_eos: bool) -> int | None:
    """The reply's token at position ``at`` (None: past its EOS)."""
    head, tail = FIRST_TOKEN_TEXT.encode(), CONTINUATION_TEXT.encode()
    if at < len(head):
        return byte_token_id(head[at])
    at -= len(head)
    if ignore_eos:
        return byte_token_id(tail[at % len(tail)])
    if at < len(tail):
        return byte_token_id(tail[at])
    return EOS_ID if at == len(tail) else None


def reply_ids(at: int, count: int, *, ignore_eos: bool = False) -> list[int]:
    """At most ``count`` tokens of the reply from position ``at`` on (EOS ends it; past its end,
    EOS alone)."""
    out: list[int] = []
    while len(out) < count:
        token = _reply_token(at + len(out), ignore_eos)
        out.append(EOS_ID if token is None else token)
        if out[-1] == EOS_ID:
            break
    return out


def reply_at(prompt: str) -> int:
    """How many tokens of the reply ``prompt``'s last assistant turn already holds (0 when it
    holds none, or text the model did not write)."""
    _, turn, written = prompt.rpartition(ASSISTANT_TURN)
    if not turn or not written:
        return 0
    cycle = CONTINUATION_TEXT.encode()
    whole = FIRST_TOKEN_TEXT.encode() + cycle * (len(written.encode()) // len(cycle) + 1)
    return len(written.encode()) if whole.startswith(written.encode()) else 0


def render(ids: list[int]) -> str:
    """Text of ``ids`` without a tokenizer: byte tokens as their bytes, specials dropped."""
    raw = bytearray()
    for i in ids:
        if i in _id_bytes():
            raw.append(_id_bytes()[i])
        elif i >= len(SPECIAL_TOKENS):
            raw += f"<{i}>".encode()
    return raw.decode(errors="replace")


NEXT_TOKENS_ENV = "TILERT_MOCK_NEXT_TOKENS"


def next_tokens(path: str) -> list[int] | None:
    """A model's greedy next token per last token (``{"next": [...]}`` at ``path``; None: ``""``).

    The decode continues the prefill's first token by it (``TILERT_MOCK_NEXT_TOKENS``)."""
    if not path:
        return None
    with open(path, "rb") as f:
        table = json.load(f)["next"]
    if not isinstance(table, list) or not all(isinstance(t, int) for t in table):
        raise ValueError(f"{NEXT_TOKENS_ENV}={path}: 'next' must be a list of token ids")
    return table


def continued(first: int, table: list[int], count: int) -> list[int]:
    """``first`` and the ``count - 1`` tokens the table continues it with (EOS ends it)."""
    ids = [first]
    while len(ids) < count and ids[-1] != EOS_ID and 0 <= ids[-1] < len(table):
        ids.append(table[ids[-1]])
    return ids
