"""--set KEY=VALUE: dotted paths, YAML-typed values, created maps, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.problems import InputError
from agent.recipe.overrides import apply_overrides, parse_override


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2", 2),
        ("1.5", 1.5),
        ("true", True),
        ('"2"', "2"),
        ("hello world", "hello world"),
        ("", None),
        ("{a: 1}", {"a": 1}),
        ("[1, 2]", [1, 2]),
        ("4:00:00", "4:00:00"),  # no YAML 1.1 base-60 surprise
        ("0755", "0755"),  # no YAML 1.1 octal surprise
        ("a=b", "a=b"),  # only the first '=' splits
    ],
)
def test_values_are_yaml_typed(text: str, value: object) -> None:
    assert parse_override(f"x.y={text}") == (["x", "y"], value)


def test_creates_missing_maps_and_keeps_the_input() -> None:
    raw = {"roles": {"prefill": {"engine": "vllm"}}}
    out = apply_overrides(raw, ["roles.prefill.env.X=1", "roles.decode.args.with-mtp=true"])
    assert out["roles"]["prefill"] == {"engine": "vllm", "env": {"X": 1}}
    assert out["roles"]["decode"] == {"args": {"with-mtp": True}}
    assert raw == {"roles": {"prefill": {"engine": "vllm"}}}


def test_later_overrides_win() -> None:
    assert apply_overrides({}, ["a.b=1", "a.b=2"]) == {"a": {"b": 2}}


@pytest.mark.parametrize("item", ["roles.decode.nodes", "=1", "a..b=1", ".a=1", "a.=1"])
def test_bad_syntax_names_the_flag(item: str) -> None:
    with pytest.raises(InputError) as info:
        apply_overrides({}, [item])
    assert f"--set {item}" in str(info.value)
    assert info.value.problems[0].hint


def test_bad_yaml_value() -> None:
    with pytest.raises(InputError) as info:
        apply_overrides({}, ["a.b=[1, 2"])
    assert "not valid YAML" in str(info.value)


def test_cannot_walk_through_a_scalar() -> None:
    with pytest.raises(InputError) as info:
        apply_overrides({"name": "x"}, ["name.sub=1"])
    assert "'name' is a str value" in str(info.value)


def test_every_bad_flag_is_reported() -> None:
    with pytest.raises(InputError) as info:
        apply_overrides({}, ["nope", "a.b=1", "x..y=2"])
    assert len(info.value.problems) == 2


# ---- values read from the environment or a file (secrets off the command line) ----------------


def test_a_value_from_the_environment_is_a_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_TOKEN", "0123")  # a string, not the integer YAML would make it
    assert parse_override("roles.decode.env.HF_TOKEN=@env:MY_TOKEN") == (
        ["roles", "decode", "env", "HF_TOKEN"],
        "0123",
    )


def test_a_value_from_a_file_drops_one_trailing_newline(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("s3cret: yes\n")
    assert parse_override(f"a.KEY=@file:{tmp_path / 'key'}") == (["a", "KEY"], "s3cret: yes")


def test_bad_indirect_values_name_the_flag_never_the_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    (tmp_path / "big").write_bytes(b"x" * (64 * 1024 + 1))
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    cases = {
        "a.K=@env:NOT_SET_ANYWHERE": "the environment has no variable 'NOT_SET_ANYWHERE'",
        f"a.K=@file:{tmp_path / 'missing'}": "cannot read",
        f"a.K=@file:{tmp_path / 'big'}": "larger than 64 KiB",
        f"a.K=@file:{tmp_path / 'binary'}": "not UTF-8 text",
    }
    for item, says in cases.items():
        with pytest.raises(InputError) as exc:
            parse_override(item)
        text = str(exc.value)
        assert f"--set {item}" in text, text
        assert says in text, text
        assert "xxxx" not in text
