"""``agent.problems.printable``: user values in one-line messages, control characters escaped."""

from __future__ import annotations

from agent.problems import printable


def test_printable_text_is_unchanged() -> None:
    for text in ("decode-1", "ünïcödé 模型", "a b\\c", ""):
        assert printable(text) == text


def test_newlines_nuls_and_escapes_are_shown_escaped() -> None:
    assert printable("a\nb") == "a\\nb"
    assert printable("x\x00y\r\t") == "x\\x00y\\r\\t"
    assert printable("\x1b[31mred") == "\\x1b[31mred"
    assert printable("line\u2028sep\x85") == "line\\u2028sep\\x85"
    assert "\n" not in printable(
        "".join(chr(c) for c in range(0x110000) if c < 0xD800 or c > 0xDFFF)
    )
