"""Whole ``--local --mock`` jobs made to fail (or to load slowly) by the stand-ins' switches:
the reason in ``status`` and ``tilert-submit diagnose`` name the cause; a decode that loads with
progress reaches ``ready`` past its fixed budget, its progress line in ``status`` meanwhile.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests import kit
from tests.test_scale import PROBE

READY_S = 90.0
STOP_S = 30.0
# The real router, probed with FAST's 0.5 s, leaves a "router starved" note in router.log the
# first time one /health takes longer (a loaded machine), and diagnose names it: "nothing is
# wrong" then fails by chance. test_scale's PROBE (5 s) keeps these jobs' logs to their subject.
FAST = (*kit.FAST, PROBE)


def _diagnose(job: Path, *flags: str) -> tuple[int, str]:
    done = kit.submit_cmd("diagnose", str(job), *flags, env=kit.clean_env())
    assert not done.stderr.strip() or done.returncode == 2, done.stderr
    return done.returncode, done.stdout


def test_failed_decode_named_in_status_and_diagnose(tmp_path: Path, router_python: Path) -> None:
    sets, _ = kit.isolated_sets(
        router_python,
        *FAST,
        "roles.decode.env.TILERT_MOCK_FAILURE=weights-incomplete",
        "roles.decode.env.TILERT_MOCK_FAULT_TARGET=decode-1",
    )
    with kit.LocalJob(tmp_path / "J", sets, env=kit.clean_env()) as job:

        def failed(status: dict[str, Any]) -> bool:
            return bool(kit.agent_entry(status, "decode-1")["state"] == "failed")

        status = kit.wait_status(job.job, failed, "decode-1 failed", READY_S)
        reason = kit.agent_entry(status, "decode-1")["reason"]
        assert "weights folder is incomplete" in reason, reason
        assert "chat_template.jinja" in reason, reason
        assert "roles.decode.convert" in reason, reason
        shown = kit.submit_cmd("status", str(job.job), env=kit.clean_env()).stdout
        assert "weights folder is incomplete" in shown, shown

        code, text = _diagnose(job.job)
        assert code == 1, text
        assert "decode-1: failed" in text, text
        assert "[weights-incomplete, fatal]" in text, text
        engine_log = kit.agent_entry(status, "decode-1")["log"]
        line = next(ln for ln in text.splitlines() if f"{engine_log}:" in ln)
        number = int(line.split(f"{engine_log}:")[1].split(":")[0])
        assert "No such file or directory" in Path(engine_log).read_text().splitlines()[number - 1]
        assert "fix: convert the weights" in text, text
        # One line shows it: the agent's own "=== decode-1 failed: ... ===" note is not counted.
        assert "[weights-incomplete, fatal] the decode" in text, text
        # decode-0 is fine: nothing found in its log.
        part = text.split("decode-0:")[1].split("\n\n")[0]
        assert "no known failure in its log" in part, part

        job.stop(STOP_S)
    # The job has ended: diagnose still reads what happened.
    code, out = _diagnose(job.job, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    decode = next(a for a in report["agents"] if a["name"] == "decode-1")
    assert decode["findings"][0]["signature"] == "weights-incomplete"
    assert decode["findings"][0]["count"] == 1
    assert decode["findings"][0]["lines"][0]["file"] == engine_log


def test_slow_decode_with_progress_is_ready_past_its_budget(
    tmp_path: Path, router_python: Path
) -> None:
    # The budget leaves the stand-in's start (imports: seconds on a busy machine) room to print its
    # first progress line; the load lasts well past it.
    budget = 15.0
    sets, _ = kit.isolated_sets(
        router_python,
        *FAST,
        f"agent.startup_budget_s.decode={budget}",
        "agent.startup_silence_s=8",
        "roles.decode.env.TILERT_MOCK_STARTUP_DELAY_S=30",
        "roles.decode.env.TILERT_MOCK_PROGRESS_EVERY_S=1",
    )
    with kit.LocalJob(tmp_path / "J", sets, env=kit.clean_env()) as job:

        def loading(status: dict[str, Any]) -> bool:
            entry = kit.agent_entry(status, "decode-0")
            return "Loading safetensors" in str(entry.get("progress") or "")

        kit.wait_status(job.job, loading, "decode-0's progress line in status.json", READY_S)
        shown = kit.submit_cmd("status", str(job.job), env=kit.clean_env()).stdout
        assert "decode-0 progress (" in shown, shown
        assert "Loading safetensors checkpoint shards" in shown, shown
        status = job.wait_state("ready", timeout=READY_S)
        for name in ("decode-0", "decode-1"):
            entry = kit.agent_entry(status, name)
            assert entry["restarts"] == 0, entry
            assert "progress" not in entry, entry
        started = kit.get(kit.agent_entry(status, "decode-0")["metrics_url"]).text
        healthy_after = [
            float(ln.rsplit(" ", 1)[1])
            for ln in started.splitlines()
            if ln.startswith("tilert_agent_time_to_healthy_seconds{")
        ]
        assert healthy_after, started[:2000]
        assert healthy_after[0] > budget, healthy_after
        code, text = _diagnose(job.job)
        assert code == 0, text
        assert "nothing is wrong" in text
        job.stop(STOP_S)
