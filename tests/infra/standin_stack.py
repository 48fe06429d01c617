"""Stand-in engines as real processes on 127.0.0.1, for tests (own process group, always reaped)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.kit.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO / "recipes" / "local-demo-model"


def standin_env(**extra: str) -> dict[str, str]:
    """This environment without inherited fault switches, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    env.update(TILERT_PD_PROBE_ADDR="127.0.0.1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class Proc:
    """A child process in its own process group, stderr+stdout to ``log``."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.argv = argv
        self.log = log
        self._file = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv,
            env=env,
            cwd=REPO,
            stdout=self._file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        """Everything logged so far."""
        return self.log.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        """Signal the process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signum)

    def wait(self, timeout: float) -> int:
        """The exit code, waiting up to ``timeout``."""
        return self.popen.wait(timeout)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; the group is gone afterwards."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(5)
        self.signal(signal.SIGKILL)
        if self.popen.poll() is None:
            self.popen.wait(5)
        self._file.close()


def wait_http(url: str, proc: Proc, timeout: float = 20.0) -> httpx.Response:
    """Poll ``url`` until it answers 200; fail early when ``proc`` exits."""

    def answer() -> httpx.Response:
        if proc.popen.poll() is not None:
            raise AssertionError(f"{proc.argv} exited {proc.popen.returncode}:\n{proc.output()}")
        return httpx.get(url, timeout=2)

    return wait_for(
        f"{url} to answer 200",
        answer,
        timeout,
        until=lambda r: r.status_code == 200,
        detail=proc.output,
    )


def decode_argv(http: int, ctrl: int, *extra: str) -> list[str]:
    """The decode stand-in's command, as the agent would build it for ``--engine tilert``."""
    return [
        sys.executable,
        "-m",
        "agent.standins.decode",
        "--engine",
        "tilert",
        "--http-port",
        str(http),
        "--ctrl-port",
        str(ctrl),
        "--model",
        "glm5",
        "--max-seq-len",
        "4096",
        "--kv-cache-dtype",
        "fp8",
        *extra,
    ]


def prefill_argv(port: int, *extra: str, tp: int = 8) -> list[str]:
    """The prefill stand-in's command with the TileRT connector configured."""
    kv = (
        '{"kv_connector":"TileRTConnector","kv_connector_module_path":"tilert.pd_vllm.prefill_connector",'
        '"kv_role":"kv_producer","kv_connector_extra_config":{"tilert_model":"glm5",'
        '"tilert_max_seq_len":4096,"tilert_transport":"mooncake"}}'
    )
    return [
        sys.executable,
        "-m",
        "agent.standins.prefill",
        "serve",
        str(DEMO_MODEL),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "demo",
        "--return-tokens-as-token-ids",
        "--kv-cache-dtype",
        "fp8_ds_mla",
        "--tensor-parallel-size",
        str(tp),
        "--max-model-len",
        "4096",
        "--kv-transfer-config",
        kv,
        *extra,
    ]
