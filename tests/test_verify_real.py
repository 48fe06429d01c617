"""The verified canary (``agent.canary.verify``) against a REAL vLLM prefill: two stand-in decodes,
one switched to wrong answers; the right one serves, the wrong one is ``failed`` naming the
mismatch, ``diagnose`` shows it, the job is ``degraded`` and every chat through the front is
answered by the right decode.

The model must make the check meaningful (a random-weight model cannot tell right from wrong):
``tests.infra.vllm_env.build_counting_model`` builds a Llama whose greedy next token is the next
ordinary token id ("x" -> "y" -> "z"), from the model's own forward pass. The right stand-in
decode continues the prefill's first token by that model's own next-token table (as a decode with
the same weights and a compatible KV would: ``TILERT_MOCK_NEXT_TOKENS``); the wrong one answers
its fixed reply whatever the prompt (``TILERT_MOCK_WRONG_ANSWERS``, as a mismatched KV would).
Both scores are printed (``pytest -s``) and are the figures of docs/agent.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agent.standins import tokens
from tests.infra.venvs import venv_python
from tests.infra.vllm_env import NEXT_TOKENS, build_counting_model, shim_dir
from tests.kit import REPO, LocalJob, clean_env, isolated_sets, submit_cmd, wait_status

pytestmark = [pytest.mark.real_vllm, pytest.mark.router]

RECIPE = REPO / "recipes" / "local-vllm.yaml"
START_S = 500.0
WRONG_TEXT = tokens.CONTINUATION_TEXT


@pytest.fixture(scope="module")
def counting_model(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model whose right answer is known (seconds to build with the venv's torch)."""
    return build_counting_model(vllm_venv, tmp_path_factory.mktemp("counting") / "model")


@pytest.fixture(scope="module")
def job(
    router_python: Path,
    vllm_venv: Path,
    counting_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalJob]:
    """The real vLLM prefill, decode-0 right, decode-1 wrong; once the head has judged them."""
    temp = Path(tempfile.mkdtemp(prefix="tv-", dir="/tmp"))  # vLLM's socket paths are short
    python = venv_python(vllm_venv)
    sets, _ = isolated_sets(
        router_python,
        f"agent.prefill_command=[{python.parent / 'vllm'}, serve]",
        f"model.path={counting_model}",
        f"frontend.args.model-path={counting_model}",
        f"roles.prefill.env.PYTHONPATH={shim_dir(vllm_venv)}",
        f"roles.decode.env.TILERT_MOCK_NEXT_TOKENS={counting_model / NEXT_TOKENS}",
        "roles.decode.env.TILERT_MOCK_WRONG_ANSWERS=1",
        "roles.decode.env.TILERT_MOCK_FAULT_TARGET=decode-1",
        "agent.canary.verify=true",
    )
    env = {**os.environ, "TMPDIR": str(temp)}
    root = tmp_path_factory.mktemp("verify")
    try:
        with LocalJob(root / "J", ["--mock", "decode", *sets], recipe=RECIPE, env=env) as running:
            wait_status(
                running.job,
                lambda s: (
                    s["state"] == "degraded"
                    and _row(s, "decode-1")["state"] == "failed"
                    and "router" in s
                    and (s["router"] or {}).get("state") == "healthy"
                ),
                "degraded with decode-1 failed",
                START_S,
                poll_s=0.5,
            )
            yield running
            running.stop(60)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _row(status: dict[str, object], name: str) -> dict[str, str]:
    agents = status["agents"]
    assert isinstance(agents, list)
    found: dict[str, str] = next(a for a in agents if a["name"] == name)
    return found


def _scores(head_log: str) -> list[tuple[float, float]]:
    found = re.findall(
        r"decode-0 answers right \(mean log-prob per token, decode vs prefill: (.*)\)", head_log
    )
    assert found, head_log[-3000:]
    return [(float(a), float(b)) for a, b in re.findall(r"(-?[\d.e-]+) vs (-?[\d.e-]+)", found[-1])]


def test_the_wrong_decode_is_failed_with_its_answers_and_the_right_one_serves(
    job: LocalJob,
) -> None:
    status = json.loads((Path(job.job) / "status.json").read_text())
    right, wrong = _row(status, "decode-0"), _row(status, "decode-1")
    assert right["state"] == "healthy", right
    assert wrong["state"] == "failed", wrong
    reason = wrong["reason"]
    for word in (
        "its answers are wrong",
        "agent.canary.verify_margin",
        "kv-cache-dtype",
        "transport",
        "model.path",
        "tilert",
        "mean log-prob",
        WRONG_TEXT[:6],
    ):
        assert word in reason, (word, reason)
    head_log = (Path(job.job) / "logs" / "prefill-0" / "agent.log").read_text(errors="replace")
    right_scores = _scores(head_log)
    wrong_scores = [
        (float(a), float(b))
        for a, b in re.findall(
            r"mean log-prob (-?[\d.e-]+)/token under the prefill's model\), prefill .*?\] "
            r"\((-?[\d.e-]+)/token\)",
            reason,
        )
    ]
    print(f"\nright decode (decode-0): mean log-prob/token, decode vs prefill: {right_scores}")
    print(f"wrong decode (decode-1): mean log-prob/token, decode vs prefill: {wrong_scores}")
    assert wrong_scores, reason
    assert all(d >= p - 1.0 for d, p in right_scores), right_scores
    assert all(d < p - 1.0 for d, p in wrong_scores), wrong_scores


def test_diagnose_shows_the_wrong_decode(job: LocalJob) -> None:
    result = submit_cmd("diagnose", str(job.job), env=clean_env())
    assert result.returncode == 1, result.stdout + result.stderr
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("decode-1: failed:"))
    assert "its answers are wrong" in line, result.stdout


def test_every_chat_through_the_front_is_answered_by_the_right_decode(job: LocalJob) -> None:
    status = json.loads((Path(job.job) / "status.json").read_text())
    front = status["front_url"]
    for i in range(6):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"count {i}"}],
            "max_tokens": 8,
        }
        response = httpx.post(f"{front}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["message"]["content"]
        assert WRONG_TEXT[:8] not in text, text
