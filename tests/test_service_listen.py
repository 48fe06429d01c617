"""``agent.service.listen``: the service front takes the listening socket systemd passes (socket
activation), as a real child process given ``LISTEN_FDS``/``LISTEN_PID`` and fd 3 gets it; and
``tilert-submit serve`` itself under ``systemd-socket-activate`` (tilert-service.socket's part)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests import kit
from tests.conftest import require
from tests.infra.ports import free_port
from tests.kit.service import ServeProc, cluster_file, nothing_left, service_sets

# The child: take the inherited socket, say where it listens and what is left of the variables,
# answer one connection, exit. An InputError is what serve would print: exit 2, one message.
CHILD = """
import os, sys
from agent.problems import InputError
from agent.service.listen import address, inherited_socket
try:
    sock = inherited_socket()
except InputError as exc:
    print(exc, file=sys.stderr)
    sys.exit(2)
if sock is None:
    print("none", flush=True)
    sys.exit(0)
left = sorted(k for k in os.environ if k.startswith("LISTEN_"))
print(address(sock), left, sock.get_inheritable(), flush=True)
sock.setblocking(True)
conn, _ = sock.accept()
conn.sendall(b"hello from the inherited socket")
conn.close()
"""


def run_child(fd: int, *, pid: str = "$$", count: str = "1") -> subprocess.Popen[str]:
    """The child with ``fd`` as its fd 3 and systemd's variables (LISTEN_PID its own pid: the
    shell's ``$$``, which ``exec`` keeps)."""
    script = (
        f"exec 3<&{fd}; exec env LISTEN_FDS={count} LISTEN_PID={pid} LISTEN_FDNAMES=front "
        f'"{sys.executable}" -c "$0"'
    )
    return subprocess.Popen(
        ["bash", "-c", script, CHILD],
        cwd=kit.REPO,
        pass_fds=(fd,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def outcome(child: subprocess.Popen[str]) -> tuple[int, str, str]:
    """The child's exit code and output; one that has not exited within 30 s (it took a socket
    it should not have, and waits on it) is killed and said so."""
    try:
        out, err = child.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        err += "\n(still running after 30 s: killed)"
    return child.returncode, out, err


def test_a_connection_made_before_the_front_starts_is_served_by_it() -> None:
    """The address is held before the process runs: a client connecting first waits in the
    backlog and is answered by the child that inherits the socket; the variables are gone from
    the child's environment and the socket is not passed on to its children."""
    with socket.create_server(("127.0.0.1", 0), backlog=8) as listener:
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        with run_child(listener.fileno()) as child:
            try:
                assert child.stdout is not None
                assert child.stderr is not None
                line = child.stdout.readline()
                assert line.strip() == f"('127.0.0.1', {port}) [] False", line + child.stderr.read()
                got = b""
                while chunk := client.recv(100):
                    got += chunk
                assert got == b"hello from the inherited socket"
                assert child.wait(30) == 0, child.stderr.read()
            finally:
                client.close()
                child.kill()


def test_sockets_meant_for_another_process_are_not_taken() -> None:
    """LISTEN_PID names another process (the variables were inherited): no socket."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with run_child(listener.fileno(), pid="1") as child:
            code, out, err = outcome(child)
        assert (code, out.strip()) == (0, "none"), err


@pytest.mark.parametrize(
    ("kind", "count", "said"),
    [
        ("udp", "1", "fd 3 is not a listening stream socket"),
        ("unlistened", "1", "fd 3 is not a listening stream socket"),
        ("tcp", "2", "systemd passed 2 sockets; the service front takes one"),
        ("tcp", "x", "LISTEN_FDS='x' is not a count"),
    ],
)
def test_what_is_not_one_listening_socket_is_refused_naming_it(
    kind: str, count: str, said: str
) -> None:
    """A datagram socket, a socket nobody listens on, two sockets, a bad count: exit 2 with a
    message naming LISTEN_FDS and how to fix the unit."""
    if kind == "udp":
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    else:
        sock = socket.socket()
        if kind == "tcp":
            sock.bind(("127.0.0.1", 0))
            sock.listen()
    with sock, run_child(sock.fileno(), count=count) as child:
        code, _, err = outcome(child)
    assert code == 2, err
    assert "LISTEN_FDS" in err, err
    assert said in err, err
    assert "ListenStream=" in err, err
    assert "Traceback" not in err, err


# ---- serve under socket activation (systemd-socket-activate, as tilert-service.socket does) -----


class ActivatedServe(ServeProc):
    """``tilert-submit serve`` started by ``systemd-socket-activate -l ADDRESS``: the socket is
    bound and listening before serve runs, and passed to it as fd 3 on the first connection."""

    def __init__(self, sdir: Path, args: list[str], listen: str) -> None:
        self.listen = listen
        super().__init__(sdir, args)

    def start(self) -> None:
        out_path = self.sdir.parent / f"{self.sdir.name}.serve-{len(self.fronts) + 1}.out"
        self.outs.append(out_path)
        out = open(out_path, "wb")  # noqa: SIM115 (closed in __exit__)
        self._outs.append(out)
        argv = ["systemd-socket-activate", "-l", self.listen, *kit.SUBMIT, "serve"]
        argv += [str(self.recipe), "--local", "--mock", "--service-dir", str(self.sdir)]
        self.fronts.append(
            subprocess.Popen(
                [*argv, *self.args],
                cwd=kit.REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )


def test_serve_takes_the_socket_systemd_holds(tmp_path: Path) -> None:
    """The address is held before serve runs; the connection that wakes it is answered by it
    (503 until a cell serves), the service's URL is the socket's, not service.front.port (which
    nobody binds), a chat streams through it, and stop S leaves nothing."""
    require(shutil.which("systemd-socket-activate") is not None, "systemd-socket-activate missing")
    held, unused = free_port(), free_port()
    sets = service_sets(unused, "slurm.time_limit='10'")
    cluster = cluster_file(tmp_path)
    url = f"http://127.0.0.1:{held}"
    args = ["--cluster", str(cluster), *sets]
    with ActivatedServe(tmp_path / "S", args, f"127.0.0.1:{held}") as serve:
        kit.wait_for("the socket held", lambda: "Listening on" in serve.output(), 30)
        assert "Execing" not in serve.output()
        # The first connection starts serve, which answers it on the inherited socket.
        first = httpx.get(f"{url}/health", timeout=60)
        assert first.status_code in (200, 503), first.text
        status = serve.wait("a cell ready", lambda s: s.get("state") == "serving", 90)
        assert status["front_url"] == url, status
        assert not _connects(unused), "service.front.port is bound: the socket was not taken"
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json={
                "model": "demo-model",
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
            timeout=60,
        ) as reply:
            body = "".join(reply.iter_text())
        assert reply.status_code == 200, body
        assert body.rstrip().endswith("data: [DONE]"), body
        done = subprocess.run(
            [*kit.SUBMIT, "stop", str(serve.sdir)],
            cwd=kit.REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert serve.proc.wait(30) == 0, serve.output()
        assert not nothing_left(serve, 10)


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True
