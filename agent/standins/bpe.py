"""A byte-level BPE tokenizer read from a model's ``tokenizer.json``, with the standard library
only.

vLLM's ``/tokenize`` answers with the model's own token ids, and TileRT's router compares them with
its own tokenizer (transformers) before it sends prompts as ids to ``/v1/completions``: the prefill
stand-in must tokenize exactly as the model does. The demo model's tokenizer
(``recipes/local-demo-model``) is a GPT-2 style byte-level BPE: added tokens are split out first,
the rest is pre-tokenized with GPT-2's pattern, each piece's UTF-8 bytes are mapped to printable
symbols and merged by rank. Python's ``re`` has no ``\\p{L}``/``\\p{N}``: letters are ``\\w``
without digits and ``_``, numbers are decimal digits, which is exact for ASCII, CJK, Greek, emoji
and the other text a test sends (other numerals such as superscripts may split differently).
"""

from __future__ import annotations

import itertools
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from agent.standins.tokens import byte_symbols

# GPT-2's pre-tokenizer pattern (tokenizers' ByteLevel with use_regex), in Python's re.
_PIECES = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
)
WORD_CACHE = 65536


class ByteLevelBPE:
    """Encodes text as the model's tokenizer does (byte-level BPE without a normalizer)."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], added: dict[str, int]):
        self.vocab = vocab
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.added = added
        self._split = (
            re.compile(
                "(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")"
            )
            if added
            else None
        )
        self._symbols = byte_symbols()
        self._word = lru_cache(maxsize=WORD_CACHE)(self._encode_word)

    @classmethod
    def load(cls, model_dir: str | Path) -> ByteLevelBPE | None:
        """The tokenizer of ``model_dir``; None when it has no byte-level BPE ``tokenizer.json``."""
        try:
            data: dict[str, Any] = json.loads((Path(model_dir) / "tokenizer.json").read_text())
        except (OSError, ValueError):
            return None
        model = data.get("model") or {}
        pre = data.get("pre_tokenizer") or {}
        if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or data.get("normalizer"):
            return None
        if pre.get("add_prefix_space"):
            return None
        merges: list[tuple[str, str]] = []
        for merge in model.get("merges") or []:
            first, _, second = merge.partition(" ") if isinstance(merge, str) else ("", "", "")
            merges.append((merge[0], merge[1]) if isinstance(merge, list) else (first, second))
        added = {t["content"]: t["id"] for t in data.get("added_tokens") or []}
        return cls(dict(model.get("vocab") or {}), merges, added)

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (added tokens such as ``<|im_start|>`` included)."""
        ids: list[int] = []
        parts = self._split.split(text) if self._split else [text]
        for part in parts:
            if not part:
                continue
            if part in self.added:
                ids.append(self.added[part])
                continue
            for piece in _PIECES.findall(part):
                ids.extend(self._word(piece))
        return ids

    def _encode_word(self, piece: str) -> tuple[int, ...]:
        symbols = [self._symbols[b] for b in piece.encode()]
        parts = self._merge(symbols)
        return tuple(self.vocab[p] for p in parts if p in self.vocab)

    def _merge(self, parts: list[str]) -> list[str]:
        """Merge the lowest-ranked adjacent pair everywhere, left to right, until none is left."""
        while len(parts) > 1:
            ranked = [
                (self.ranks[pair], i)
                for i, pair in enumerate(itertools.pairwise(parts))
                if pair in self.ranks
            ]
            if not ranked:
                break
            _, i = min(ranked)
            first, second = parts[i], parts[i + 1]
            merged: list[str] = []
            j = 0
            while j < len(parts):
                if j + 1 < len(parts) and parts[j] == first and parts[j + 1] == second:
                    merged.append(first + second)
                    j += 2
                else:
                    merged.append(parts[j])
                    j += 1
            parts = merged
        return parts
