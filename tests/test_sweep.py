"""Sweeps under bad input (issue 19): bounded and counted before anything is expanded, every
placeholder a sweep key, job names checked for collisions, nothing written unless every
combination validates, one combination with ``--set ... --unset sweep`` (also ``--local``), and
Ctrl-C or a writer-less pipe ending the submitter with one line. The sweep itself (products,
names, one bad combination) is in tests/test_benchmark.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.problems import InputError
from agent.recipe import overrides
from agent.recipe.loader import load_recipe, recipe_sweep
from agent.recipe.sweep import MAX_JOBS, read_sweep
from submit.cli import main as submit_main
from tests.kit import DEMO_RECIPE
from tests.test_benchmark import sweep_recipe


def test_a_sweep_is_counted_before_it_is_expanded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 8 keys of 10 values: 100,000,000 combinations, refused at once (never built).
    raw = {
        "name": "x",
        "env": {f"k{i}": f"{{k{i}}}" for i in range(8)},
        "sweep": {f"k{i}": list(range(10)) for i in range(8)},
    }
    started = time.monotonic()
    with pytest.raises(InputError) as caught:
        read_sweep(raw)
    assert time.monotonic() - started < 5  # counted, not expanded (a bound, not a speed target)
    text = str(caught.value)
    assert "100,000,000 combinations (10 x 10 x 10 x 10 x 10 x 10 x 10 x 10)" in text
    assert f"more than the limit of {MAX_JOBS} jobs" in text
    assert "--max-jobs 100000000" in text
    # Through the submitter: exit 2, one message, nothing written.
    path = sweep_recipe(tmp_path)
    text = path.read_text().replace("seq: [4096, 8192]", "seq: [4096, 8192, 2048]")
    path.write_text(text)
    out = tmp_path / "j"
    assert (
        submit_main([str(path), "--mock", "--dry-run", "--job-dir", str(out), "--max-jobs", "5"])
        == 2
    )
    err = capsys.readouterr().err
    assert "6 combinations (2 x 3), more than the limit of 5 jobs" in err
    assert "Traceback" not in err
    assert not out.exists()
    assert (
        submit_main([str(path), "--mock", "--dry-run", "--job-dir", str(out), "--max-jobs", "6"])
        == 0
    )
    assert "sweep: 6 jobs" in capsys.readouterr().out


def test_max_jobs_must_be_a_positive_number(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "-1", "many"):
        with pytest.raises(SystemExit) as exited:
            submit_main([str(DEMO_RECIPE), "--dry-run", "--max-jobs", bad])
        assert exited.value.code == 2
        assert "--max-jobs" in capsys.readouterr().err


def test_every_placeholder_must_be_a_sweep_key(tmp_path: Path) -> None:
    path = sweep_recipe(tmp_path)
    with pytest.raises(InputError) as caught:
        recipe_sweep(path, overrides=["environment.WEIGHTS=/models/{variant}/w"])
    said = str(caught.value)
    assert "environment.WEIGHTS" in said
    assert '"{variant}" is not a sweep key (the sweep has: conc, seq)' in said
    # The shell's ${NAME} in a custom command is not a placeholder.
    assert read_sweep({"benchmark": {"command": "echo ${HOME} {c}"}, "sweep": {"c": [1]}})


def test_values_that_clean_up_to_one_job_name_are_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = sweep_recipe(tmp_path)
    path.write_text(
        path.read_text().replace("seq: [4096, 8192]", 'seq: [4096], tag: ["a b", "a_b"]')
    )
    out = tmp_path / "j"
    tag = ["--set", 'environment.TAG="{tag}"']  # the flags come before the sweep's values
    assert submit_main([str(path), "--mock", "--job-dir", str(out), *tag]) == 2
    err = capsys.readouterr().err
    assert "combinations conc=1, seq=4096, tag=a b and conc=1, seq=4096, tag=a_b" in err
    assert "both named 'local-demo-conc1-seq4096-taga_b'" in err
    assert "--job-dir" not in err
    assert "nothing was submitted" in err
    assert not out.exists()


def test_one_combination_with_set_and_unset_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = sweep_recipe(tmp_path)
    one = [
        "--set",
        "benchmark.concurrencies=[4]",
        "--set",
        "roles.decode.args.max-seq-len=8192",
        "--set",
        "roles.prefill.args.max-model-len=8192",
        "--set",
        "roles.prefill.args.kv-transfer-config.kv_connector_extra_config.tilert_max_seq_len=8192",
        "--unset",
        "sweep",
    ]
    assert recipe_sweep(path, overrides=one[1:-2:2], unsets=["sweep"]) is None
    loaded = load_recipe(path, overrides=one[1:-2:2], unsets=["sweep"])
    assert loaded.recipe.benchmark.concurrencies == [4]
    assert loaded.recipe.name == "local-demo"
    # --local accepts it (a dry run: the plan, nothing started)
    out = tmp_path / "one"
    assert (
        submit_main([str(path), "--mock", "--local", "--dry-run", "--job-dir", str(out), *one]) == 0
    )
    assert "Job directory:" in capsys.readouterr().out
    # A placeholder left without its --set: named, with the flag that gives it.
    assert submit_main([str(path), "--mock", "--dry-run", "--unset", "sweep"]) == 2
    err = capsys.readouterr().err
    assert '"{conc}" has no value' in err
    assert "--set benchmark.concurrencies[0]=VALUE" in err


def test_a_pipe_without_a_writer_is_waited_for_with_a_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    monkeypatch.setattr(overrides, "FROM_FILE_WAIT_S", 0.5)
    with pytest.raises(InputError, match=r"gave no end of its value within 0\.5s"):
        overrides.read_indirect("--set x", f"@file:{fifo}")


def test_ctrl_c_while_waiting_ends_with_one_line_and_130(tmp_path: Path) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    argv = [
        sys.executable,
        "-m",
        "submit.cli",
        str(DEMO_RECIPE),
        "--dry-run",
        "--set",
        f"environment.TOKEN=@file:{fifo}",
    ]
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            assert proc.stderr is not None
            said = proc.stderr.readline()  # the wait is said: Ctrl-C comes during it
            assert f"waiting for {fifo} (a pipe)" in said
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 130
            rest = proc.stderr.read()
            assert rest.strip() == "tilert-submit: interrupted", rest
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
