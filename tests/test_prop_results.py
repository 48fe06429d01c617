"""Property: no AIPerf export or record file makes the results readers raise anything but
``ResultsError``, and judging a level never raises (issue 19: a malformed export once took the
head agent down). The inputs: arbitrary JSON, AIPerf's export with any of its values replaced by
an arbitrary one (the likely damage: a new release that changes a field's type), and raw bytes.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from agent.benchmark.aiperf import EXPORT_FILE, RECORDS_FILE
from agent.benchmark.results import ResultsError, read_level, read_records
from agent.benchmark.runner import judge_level
from tests.propkit import EXTREME_INTS, ODD_TEXT, examples
from tests.test_benchmark import EXPORT

# JSON as a client could write it: Python's json allows NaN and Infinity, so they are in here too.
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    EXTREME_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    ODD_TEXT,
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(ODD_TEXT, inner, max_size=4)
    ),
    max_leaves=16,
)


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in ``tree`` (to dicts, lists and leaves)."""
    out = [prefix]
    if isinstance(tree, dict):
        for key, value in tree.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            out += _paths(value, (*prefix, i))
    return out


EXPORT_PATHS = _paths(EXPORT)[1:]


def _replaced(path: tuple[Any, ...], value: Any) -> Any:
    tree = copy.deepcopy(EXPORT)
    node: Any = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return tree


def _judge(folder: Path) -> None:
    """What the runner does with a level's folder: never raises, and a level that passed has
    measured output tokens."""
    level = judge_level(
        folder,
        gpus=8,
        concurrency=4,
        exit_code=0,
        requested=None,
        max_error_rate=0.0,
        client_said=None,
    )
    assert level.passed == (level.error is None)
    if level.passed:
        assert level.output_tokens > 0
    for name in ("duration_s", "output_throughput", "ttft_p50_ms"):
        value = getattr(level, name)
        assert value is None or math.isfinite(value)


def _refusal(read: Callable[[], object]) -> str | None:
    """Why ``read`` refused its file (ResultsError's message), or None when it read it."""
    try:
        read()
    except ResultsError as exc:
        return str(exc)
    return None


def _check(folder: Path, text: bytes) -> None:
    (folder / EXPORT_FILE).write_bytes(text)
    (folder / RECORDS_FILE).write_bytes(text)
    for refused in (
        _refusal(lambda: read_level(folder, gpus=8)),
        _refusal(lambda: read_records(folder)),
    ):
        assert refused is None or str(folder) in refused
    _judge(folder)


@examples(300)
@given(data=JSON)
def test_arbitrary_json_is_read_or_refused(tmp_path_factory: Any, data: Any) -> None:
    folder = tmp_path_factory.mktemp("level")
    _check(folder, json.dumps(data).encode())


@examples(300)
@given(path=st.sampled_from(EXPORT_PATHS), value=JSON)
def test_aiperf_export_with_one_value_changed(
    tmp_path_factory: Any, path: tuple[Any, ...], value: Any
) -> None:
    folder = tmp_path_factory.mktemp("level")
    _check(folder, json.dumps(_replaced(path, value)).encode())


@examples(100)
@given(lines=st.lists(JSON, max_size=6))
def test_arbitrary_records(tmp_path_factory: Any, lines: list[Any]) -> None:
    folder = tmp_path_factory.mktemp("level")
    (folder / RECORDS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    refused = _refusal(lambda: read_records(folder))
    if refused is None:
        ok, failed, tokens, said = read_records(folder)
        assert ok + failed == len(lines)
        assert tokens >= 0
        assert said is None or said.isprintable()
    else:
        assert str(folder) in refused
    _judge(folder)


@examples(100)
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes(tmp_path_factory: Any, raw: bytes) -> None:
    _check(tmp_path_factory.mktemp("level"), raw)
