"""Command builders (``agent.launch.commands``) on the demo recipe's real plan."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import msgspec
import pytest

from agent.job.plan import Plan, load_plan
from agent.launch.commands import (
    GPU_ENV_NAMES,
    STANDIN_MODULES,
    DecodeEndpoint,
    decode_command,
    prefill_command,
    router_command,
)
from agent.node.secretenv import missing_secrets, say_missing_secrets
from tests.kit import make_job

SECRET = "s3cr3t-value-never-in-argv"
AGENT_ENV = {"PATH": "/usr/bin", "HF_TOKEN": SECRET, "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    """The demo's --mock plan, with HF_TOKEN a secret of every role."""
    job = make_job(
        tmp_path_factory.mktemp("commands"),
        "roles.decode.env.HF_TOKEN=from-recipe",
        "roles.prefill.env.HF_TOKEN=from-recipe",
        "frontend.env.HF_TOKEN=from-recipe",
    )
    text = (job / "plan.json").read_bytes()
    assert b"from-recipe" not in text  # the plan never holds a secret value
    return load_plan(text)


def real(plan: Plan) -> Plan:
    """The same plan without --mock."""
    return msgspec.structs.replace(plan, standins=[])


def flag(argv: list[str], name: str) -> str:
    """The value after ``name`` (which must appear exactly once)."""
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


def test_decode_argv_and_env(plan: Plan) -> None:
    cmd = decode_command(
        real(plan),
        name="decode-1",
        address="127.0.0.1",
        http_port=6101,
        ctrl_port=5601,
        agent_env=AGENT_ENV,
    )
    assert cmd.argv[:3] == ["python", "-m", "tilert.pd_vllm.decode_server"]
    assert flag(cmd.argv, "--engine") == "tilert"
    assert flag(cmd.argv, "--http-port") == "6101"
    assert flag(cmd.argv, "--ctrl-port") == "5601"
    assert flag(cmd.argv, "--model") == "glm5"
    assert cmd.env["TILERT_PD_PROBE_ADDR"] == "127.0.0.1"
    assert cmd.env["TILERT_AGENT_NAME"] == "decode-1"
    assert cmd.env["TILERT_PD_SENDERS"] == "1"
    assert cmd.env["HF_TOKEN"] == SECRET
    assert not any(SECRET in a or "from-recipe" in a for a in cmd.argv)


def test_mock_swaps_the_program_and_keeps_the_args(plan: Plan) -> None:
    kw = dict(name="decode-0", address="127.0.0.1", http_port=1, ctrl_port=2, agent_env=AGENT_ENV)
    mock, prod = decode_command(plan, **kw), decode_command(real(plan), **kw)  # type: ignore[arg-type]
    assert mock.argv[:3] == [sys.executable, "-m", STANDIN_MODULES["decode"]]
    assert mock.argv[3:] == prod.argv[3:]
    pre_mock = prefill_command(
        plan, name="prefill-0", host="127.0.0.1", http_port=3, agent_env=AGENT_ENV
    )
    pre_prod = prefill_command(
        real(plan), name="prefill-0", host="127.0.0.1", http_port=3, agent_env=AGENT_ENV
    )
    assert pre_mock.argv[:3] == [sys.executable, "-m", STANDIN_MODULES["prefill"]]
    assert pre_prod.argv[:2] == ["vllm", "serve"]
    assert pre_mock.argv[3:] == pre_prod.argv[1:]  # "serve MODEL ..." kept
    assert flag(pre_prod.argv, "--port") == "3"
    assert flag(pre_prod.argv, "--host") == "127.0.0.1"
    assert pre_prod.env["HF_TOKEN"] == SECRET
    assert not any(SECRET in a for a in pre_prod.argv)


def test_router_has_one_decode_flag_with_every_node_and_no_gpu(plan: Plan) -> None:
    decodes = [DecodeEndpoint("10.0.0.1", 5600, 6100), DecodeEndpoint("10.0.0.2", 5601, 6101)]
    env = {**AGENT_ENV, "CUDA_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "0"}
    cmd = router_command(
        plan,
        prefill_url="http://10.0.0.9:8100",
        decodes=decodes,
        host="127.0.0.1",
        use_standin=False,
        agent_env=env,
    )
    assert cmd.argv[:3] == ["python", "-m", "tilert.pd_vllm.pd_router"]
    assert cmd.argv.count("--decode") == 1
    i = cmd.argv.index("--decode")
    assert cmd.argv[i + 1 : i + 3] == ["10.0.0.1:5600:6100", "10.0.0.2:5601:6101"]
    assert cmd.argv[i + 3].startswith("--")
    assert flag(cmd.argv, "--vllm-url") == "http://10.0.0.9:8100"
    assert flag(cmd.argv, "--port") == str(plan.router.port)
    for var in GPU_ENV_NAMES:
        assert cmd.env[var] == "", var
    assert cmd.env["HF_TOKEN"] == SECRET
    assert not any(SECRET in a for a in cmd.argv)
    standin = router_command(
        plan, prefill_url="http://x:1", decodes=decodes, host="h", use_standin=True, agent_env=env
    )
    assert standin.argv[:3] == [sys.executable, "-m", STANDIN_MODULES["router"]]


def test_secret_absent_from_agent_env_stays_absent(plan: Plan) -> None:
    cmd = decode_command(
        plan,
        name="decode-0",
        address="127.0.0.1",
        http_port=1,
        ctrl_port=2,
        agent_env={"PATH": "/usr/bin"},
    )
    assert "HF_TOKEN" not in cmd.env


def test_a_role_secret_stays_with_its_role(tmp_path: Path) -> None:
    """A secret the recipe gives the prefill only does not reach decode engines or the router."""
    job = make_job(tmp_path, "roles.prefill.env.HF_TOKEN=from-recipe")
    plan = load_plan((job / "plan.json").read_bytes())
    env = {**AGENT_ENV, "UNRELATED_KEY": "kept"}
    prefill = prefill_command(
        plan, name="prefill-0", host="127.0.0.1", http_port=8100, agent_env=env
    )
    decode = decode_command(
        plan, name="decode-0", address="127.0.0.1", http_port=6100, ctrl_port=5600, agent_env=env
    )
    router = router_command(
        plan,
        prefill_url="http://127.0.0.1:8100",
        decodes=[DecodeEndpoint("127.0.0.1", 5600, 6100)],
        host="127.0.0.1",
        use_standin=True,
        agent_env=env,
    )
    assert prefill.env["HF_TOKEN"] == SECRET
    assert "HF_TOKEN" not in decode.env
    assert "HF_TOKEN" not in router.env
    # A secret of the agent's own environment that no recipe names is inherited as usual.
    assert decode.env["UNRELATED_KEY"] == "kept"


def test_the_secrets_an_agent_lacks_are_named_with_who_needs_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each role's own secrets count; the head's router's too (agent.node.secretenv)."""
    job = make_job(
        tmp_path,
        "roles.prefill.env.API_KEY=x",
        "frontend.env.HF_TOKEN=x",
        "environment.DB_PASSWORD=x",
    )
    plan = load_plan((job / "plan.json").read_bytes())
    assert missing_secrets(plan, "decode", {"PATH": "/usr/bin"}, head=False) == {
        "DB_PASSWORD": ["decode"]
    }
    assert missing_secrets(plan, "prefill", {"API_KEY": "k", "DB_PASSWORD": ""}, head=True) == {
        "DB_PASSWORD": ["prefill", "router"],  # empty is missing
        "HF_TOKEN": ["router"],
    }
    everything = {"API_KEY": "k", "HF_TOKEN": "t", "DB_PASSWORD": "p"}
    assert missing_secrets(plan, "prefill", everything, head=True) == {}
    caplog.set_level(logging.WARNING)
    log = logging.getLogger("test")
    said = say_missing_secrets(plan, "prefill", {}, log, who="prefill-1", head=False)
    assert said == ["API_KEY", "DB_PASSWORD"]
    assert (
        "prefill-1: API_KEY is not in this agent's environment, and the recipe gives it to its "
        "prefill" in caplog.text
    )
