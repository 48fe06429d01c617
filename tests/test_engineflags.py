"""Engine flags checked by the engine itself (docs/preflight.md): each program's own ``--help`` is
read on the node, a flag it does not list is refused naming the key, the image, the version and
the closest flag, and the answer is cached per image and version. With the stand-ins, the real
TileRT router and (marked ``real_vllm``) the real vLLM 0.32 of the tests."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import msgspec
import pytest

from agent.job.plan import Plan, load_plan
from agent.job.preflightpolicy import PreflightPolicy
from agent.launch import LaunchSpec, ProcessLauncher
from agent.launch.commands import decode_command, prefill_command, router_command
from agent.launch.enginechecks import flag_question
from agent.launch.engineflags import (
    FLAG_CACHE_ENV,
    cache_dir,
    check_flags,
    flag_refusals,
    parse_help,
    vllm_program,
)
from tests.infra.vllm_env import shim_dir
from tests.kit import make_job

ROUTER_HELP = """usage: pd_router.py [-h] --vllm-url VLLM_URL --decode DECODE [DECODE ...]
                    [--host HOST] [--queue-timeout QUEUE_TIMEOUT] [--force-include-usage]

options:
  -h, --help            show this help message and exit
  --vllm-url VLLM_URL
  --decode DECODE [DECODE ...]
                        decode nodes as host:ctrl_port:http_port
  --model-path MODEL_PATH
                        tokenizer path (required unless --parser none)
  --default-temperature DEFAULT_TEMPERATURE
                        override the resolved temperature (vLLM: --override-generation-config)
  --enforce-eager, --no-enforce-eager
"""


class NothingRuns(ProcessLauncher):
    """A launcher whose short commands fail the test: the answer must come from the cache."""

    async def run(self, spec: LaunchSpec, *, timeout_s: float) -> tuple[int, bytes]:
        raise AssertionError(f"{spec.argv} was run (bound {timeout_s}s); the cache should answer")


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    """The demo's --mock plan."""
    return load_plan((make_job(tmp_path_factory.mktemp("flags")) / "plan.json").read_bytes())


def test_a_help_text_lists_its_options_not_the_flags_its_descriptions_mention() -> None:
    flags = parse_help(ROUTER_HELP)
    assert {"--vllm-url", "--decode", "--host", "--queue-timeout", "--help"} <= flags
    assert {"--model-path", "--default-temperature", "--enforce-eager", "--no-enforce-eager"} <= (
        flags
    )
    # Named inside descriptions only: not options of this program.
    assert "--parser" not in flags
    assert "--override-generation-config" not in flags


def test_only_vllms_own_server_is_asked() -> None:
    assert vllm_program(["vllm", "serve"]) == ["vllm", "serve"]
    assert vllm_program(["/venv/bin/vllm", "serve", "--model"]) == ["/venv/bin/vllm", "serve"]
    assert vllm_program(["python", "-m", "vllm.entrypoints.openai.api_server", "--model"]) == [
        "python",
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    # A site's launcher may start vLLM on --help, or print something else: never asked.
    assert vllm_program(["/site/run-vllm.sh"]) is None


def test_the_cache_folder_is_the_setting_else_the_variable_else_the_users_cache() -> None:
    assert cache_dir("/x/flags", {FLAG_CACHE_ENV: "/y"}) == Path("/x/flags")
    assert cache_dir(None, {FLAG_CACHE_ENV: "/y"}) == Path("/y")
    assert cache_dir(None, {"XDG_CACHE_HOME": "/c"}) == Path("/c/tilert-agent/engine-flags")


def test_each_flag_is_named_by_where_it_comes_from(plan: Plan) -> None:
    p = msgspec.structs.replace(plan, standins=[])
    argv = decode_command(p, name="decode-0", address="127.0.0.1", http_port=1, ctrl_port=2).argv
    question = flag_question(p, "decode", argv, standin=False)
    origins = {f.flag: f.origin for f in question.flags}
    assert origins["--max-seq-len"] == "roles.decode.args.max-seq-len"
    assert origins["--ctrl-port"] == "--ctrl-port (passed by tilert-agent itself)"
    assert question.help_argvs == [[*p.decode.program, "--help"]]
    assert not question.standin


async def test_a_stand_in_lists_its_flags_and_an_unknown_one_is_only_a_note(
    plan: Plan, tmp_path: Path
) -> None:
    prefill = msgspec.structs.replace(plan.prefill, args=[*plan.prefill.args, "--enforce-eager"])
    p = msgspec.structs.replace(plan, prefill=prefill)
    command = prefill_command(p, name="prefill-0", host="127.0.0.1", http_port=1)
    question = flag_question(p, "prefill", command.argv, standin=True)
    # The stand-in answers vLLM's --help=all like vLLM does.
    assert question.help_argvs[0][-2:] == ["serve", "--help=all"]
    verdict = await check_flags(
        ProcessLauncher(),
        LaunchSpec("flags", [], command.env),
        question,
        versions={},
        folder=tmp_path / "cache",
        timeout_s=60,
    )
    assert verdict.problems == []
    assert any("--enforce-eager" in note and "ignores it" in note for note in verdict.notes)
    assert "--served-model-name" not in " ".join(verdict.notes)
    # Cached too, keyed by the stand-in's source file: the next agent does not ask again.
    assert question.fingerprint
    again = await check_flags(
        NothingRuns(),
        LaunchSpec("flags", [], command.env),
        question,
        versions={},
        folder=tmp_path / "cache",
        timeout_s=60,
    )
    assert again.notes == verdict.notes
    assert "cached in" in again.summary


def router_question(plan: Plan, router_python: Path, **args: str) -> tuple[Plan, list[str]]:
    extra = [w for k, v in args.items() for w in (f"--{k}", v)]
    router = msgspec.structs.replace(
        plan.router,
        program=[str(router_python), "-m", "tilert.pd_vllm.pd_router"],
        args=[*plan.router.args, *extra],
    )
    p = msgspec.structs.replace(plan, router=router, standins=[])
    argv = router_command(p, prefill_url="", decodes=[], host="", use_standin=False).argv
    return p, argv


@pytest.mark.router
async def test_the_real_router_refuses_a_flag_it_does_not_know_and_the_answer_is_cached(
    plan: Plan, router_python: Path, tmp_path: Path
) -> None:
    p, argv = router_question(plan, router_python, **{"queue-timout": "30"})
    question = flag_question(p, "router", argv, standin=False)
    versions = {"tilert": "0.1.6.post3"}
    spec = LaunchSpec("router-preflight", [], {"PATH": "/usr/bin:/bin"}, image=None)
    folder = tmp_path / "cache"
    verdict = await check_flags(
        ProcessLauncher(), spec, question, versions=versions, folder=folder, timeout_s=120
    )
    assert len(verdict.problems) == 1, verdict
    problem = verdict.problems[0]
    assert problem.startswith("frontend.args.queue-timout: the TileRT router (tilert 0.1.6.post3)")
    assert "does not know --queue-timout (did you mean --queue-timeout?)" in problem
    assert "the node's installation (no image)" in problem
    assert "asked now" in verdict.summary
    cached = list(folder.iterdir())
    assert len(cached) == 1
    assert cached[0].name.startswith("tilert-0.1.6.post3-")
    # The second check reads the cache: a launcher that runs nothing still answers.
    again = await check_flags(
        NothingRuns(), spec, question, versions=versions, folder=folder, timeout_s=120
    )
    assert again.problems == verdict.problems
    assert "cached in" in again.summary
    # Another version is another entry: asked again.
    other = await check_flags(
        ProcessLauncher(),
        spec,
        question,
        versions={"tilert": "0.1.7"},
        folder=folder,
        timeout_s=120,
    )
    assert "asked now" in other.summary
    assert len(list(folder.iterdir())) == 2


@pytest.mark.router
async def test_the_policy_warns_or_skips_instead_of_refusing(
    plan: Plan, router_python: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    p, argv = router_question(plan, router_python, **{"queue-timout": "30"})
    question = flag_question(p, "router", argv, standin=False)
    spec = LaunchSpec("router-preflight", [], {"PATH": "/usr/bin:/bin"})
    log = logging.getLogger("test-flags")
    for setting, refused in (("check", 1), ("warn", 0), ("off", 0)):
        policy = PreflightPolicy(engine_flags=setting, flag_cache_dir=str(tmp_path))  # type: ignore[arg-type]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="test-flags"):
            out = await flag_refusals(
                ProcessLauncher(), spec, question, versions={}, policy=policy, log=log, who="head"
            )
        assert len(out) == refused
        warned = "agent.preflight.engine_flags: warn" in caplog.text
        assert warned == (setting == "warn")


async def test_a_program_that_lists_no_flags_is_a_note_not_a_refusal(
    plan: Plan, tmp_path: Path
) -> None:
    p = msgspec.structs.replace(plan, standins=[])
    argv = decode_command(p, name="decode-0", address="127.0.0.1", http_port=1, ctrl_port=2).argv
    question = flag_question(p, "decode", argv, standin=False)
    # `python -c pass --help` prints nothing: the flags cannot be listed.
    silent = dataclasses.replace(question, help_argvs=[[sys.executable, "-c", "pass"]])
    verdict = await check_flags(
        ProcessLauncher(),
        LaunchSpec("d", [], {}),
        silent,
        versions={},
        folder=tmp_path,
        timeout_s=30,
    )
    assert verdict.problems == []
    assert "could not be listed" in verdict.notes[0]
    assert "listing 0 flags" in verdict.notes[0]


@pytest.mark.real_vllm
async def test_the_real_vllm_refuses_a_flag_that_vllm_032_does_not_have(
    plan: Plan, vllm_venv: Path, tmp_path: Path
) -> None:
    python = vllm_venv / "bin" / "python"
    prefill = msgspec.structs.replace(
        plan.prefill,
        program=[str(vllm_venv / "bin" / "vllm"), "serve", "/models/x"],
        args=[
            "--max-modle-len",
            "1024",
            "--max_num_seqs",
            "4",
            "--compilation-config.mode",
            "0",
            "--enforce-eager",
        ],
        env={"PYTHONPATH": str(shim_dir(vllm_venv))},
    )
    p = msgspec.structs.replace(plan, prefill=prefill, standins=[])
    command = prefill_command(p, name="prefill-0", host="127.0.0.1", http_port=1)
    question = flag_question(p, "prefill", command.argv, standin=False)
    assert question.help_argvs[0][-2:] == ["serve", "--help=all"]
    assert python.exists()
    verdict = await check_flags(
        ProcessLauncher(),
        LaunchSpec("prefill-0-preflight", [], command.env, image=None),
        question,
        versions={"vllm": "0.32.0"},
        folder=tmp_path,
        timeout_s=300,
    )
    # vLLM reads --max_num_seqs as --max-num-seqs and --a.b as --a: only the typo is refused.
    assert len(verdict.problems) == 1, verdict
    problem = verdict.problems[0]
    assert problem.startswith("roles.prefill.args.max-modle-len: vLLM (vllm 0.32.0)")
    assert "does not know --max-modle-len (did you mean --max-model-len?)" in problem
