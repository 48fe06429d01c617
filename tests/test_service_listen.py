"""``agent.service.listen``: the service front takes the listening socket systemd passes (socket
activation), as a real child process given ``LISTEN_FDS``/``LISTEN_PID`` and fd 3 gets it."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests import kit

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
            out, err = child.communicate(timeout=30)
        assert (child.returncode, out.strip()) == (0, "none"), err


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
        _, err = child.communicate(timeout=30)
    assert child.returncode == 2, err
    assert "LISTEN_FDS" in err, err
    assert said in err, err
    assert "ListenStream=" in err, err
    assert "Traceback" not in err, err
