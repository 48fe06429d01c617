"""The verified canary's judgement (``agent.head.verify``) on answers and scores given here; against
a real vLLM prefill and stand-in decodes: tests/test_verify_real.py."""

from __future__ import annotations

import pytest

from agent.facts import derive_rid
from agent.head.verify import (
    AGREE_TOKENS,
    Inconclusive,
    Reference,
    _logprob_of,
    _token_id,
    judge,
    verdict,
)

# The counting model's figures (tests/test_verify_real.py): its own tokens score about -7e-5 a
# token, a token it would not say about -16.
REF = Reference("fox", [1, 2], [91, 92, 93, 94, 95, 96, 97, 98], [-7e-5] * 8, "yz{|}~")
RIGHT = [91, 92, 93, 94, 95, 96, 97, 98]
WRONG = [91, 40, 77, 70, 70, 80]


def test_the_prefill_s_own_answer_passes_by_agreement() -> None:
    judged = judge(REF, RIGHT, [-7e-5] * 8, margin=1.0)
    assert judged.agree
    assert judged.passed
    assert judged.score == pytest.approx(-7e-5)


def test_a_wrong_answer_fails_and_its_score_is_low() -> None:
    judged = judge(REF, WRONG, [-7e-5, -16.0, -15.0, -17.0, -16.5, -14.0], margin=1.0)
    assert not judged.agree
    assert not judged.passed
    assert judged.score < judged.own - 1.0
    assert "mean log-prob -15.7/token" in judged.describe()


def test_a_different_answer_that_scores_within_the_margin_passes() -> None:
    # A near tie (fp8 against bf16 can flip one): the tokens differ, the score is close.
    other = [91, 92, 99, 94, 95, 96, 97, 98]
    judged = judge(REF, other, [-7e-5, -7e-5, -0.9, -0.2, -0.1, -0.1, -0.1, -0.1], margin=1.0)
    assert not judged.agree
    assert judged.passed
    assert not judge(REF, other, [-7e-5, -7e-5, -9.0, -9.0, -9, -9, -9, -9], margin=1.0).passed


def test_agreement_is_on_the_decode_s_tokens_not_the_prefill_s_first() -> None:
    # The first token is the prefill's: an answer of it alone proves nothing.
    assert not judge(REF, [91], [-7e-5], margin=0.0).agree
    assert judge(REF, RIGHT[: 1 + AGREE_TOKENS], [-1.0] * 5, margin=0.0).agree


def test_a_decode_is_wrong_when_most_prompts_fail_and_the_reason_names_all() -> None:
    good = judge(REF, RIGHT, [-7e-5] * 8, margin=1.0)
    bad = judge(REF, WRONG, [-7e-5, -16.0, -15.0, -17.0, -16.5, -14.0], margin=1.0)
    assert verdict("decode-1", [good, good, bad], 1.0).wrong is None
    found = verdict("decode-1", [good, bad, bad], 1.0).wrong
    assert found is not None
    for word in (
        "2 of 3 prompts",
        "agent.canary.verify_margin",
        "roles.decode.args.kv-cache-dtype",
        "kv_connector_extra_config.tilert_transport",
        "frameworks.tilert",
        "'fox'",
    ):
        assert word in found, (word, found)


def test_vllm_s_shapes_are_read_or_refused() -> None:
    assert _token_id("token_id:42") == 42
    with pytest.raises(Inconclusive):
        _token_id("hello")
    entry = {"91": {"logprob": -7.7e-05, "rank": 1, "decoded_token": "y"}}
    assert _logprob_of(entry, 91) == pytest.approx(-7.7e-05)
    with pytest.raises(Inconclusive):
        _logprob_of(None, 91)


def test_the_rid_both_sides_derive() -> None:
    assert derive_rid("cmpl-b720df1ac18f3a8f") == "b720df1ac18f3a8f"
    assert derive_rid("cmpl-b720df1ac18f3a8f-0-1a2b3c4d") == "b720df1ac18f3a8f"
