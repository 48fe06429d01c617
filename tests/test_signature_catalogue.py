"""The failure signature catalogue (``agent.signatures``): one stand-in switch per signature in
the program whose log shows it, layout versions in words, and docs/diagnose.md listing each.
Every switch through a real supervisor and ``diagnose``: tests/test_signatures.py.
"""

from __future__ import annotations

from agent.signatures import BY_NAME, SIGNATURES, describe_layout, for_role, match_line
from agent.standins.failmodes import MODES
from tests import kit


def test_catalogue_has_one_switch_per_signature() -> None:
    """At least 20 signatures, named uniquely, each with a stand-in switch in the right program."""
    assert len(SIGNATURES) >= 20
    assert len(BY_NAME) == len(SIGNATURES)
    assert set(MODES) == set(BY_NAME)
    for name, mode in MODES.items():
        assert mode.program in BY_NAME[name].where, name


def test_layout_versions_in_words() -> None:
    assert describe_layout("10") == "glm5 fp8_ds_mla, v10"
    assert describe_layout("50") == "glm5 bf16, v50"
    assert describe_layout("312") == "glm5_2 ROCm fp8, tiled KI, v312"
    assert describe_layout("7") == "layout v7"
    found = match_line("AssertionError: layout version mismatch: 50 vs 10", for_role("prefill"))
    assert found is not None
    assert "between prefill (glm5 fp8_ds_mla, v10) and decode (glm5 bf16, v50)" in found.reason()
    assert "roles.decode.args.kv-cache-dtype" in found.reason()


def test_docs_list_every_signature_with_its_regex() -> None:
    text = (kit.REPO / "docs" / "diagnose.md").read_text()
    for sig in SIGNATURES:
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{sig.name}` |")), None)
        assert row is not None, f"docs/diagnose.md lacks {sig.name}"
        assert sig.pattern.replace("|", "\\|") in row, f"docs/diagnose.md: {sig.name}'s regex"
