"""``agent.ports``: a port counts as free only when bindable on IPv4 *and* ``::``."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from agent.node.ports import choose_port, choose_ports, is_bindable
from tests.infra.ports import free_ports


def ipv6_available() -> bool:
    """Whether this machine can bind IPv6 sockets at all."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture
def held() -> Iterator[list[socket.socket]]:
    """Sockets a test holds; closed afterwards."""
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


def hold(held: list[socket.socket], family: int, host: str, port: int) -> None:
    """Bind and listen on (host, port) like a server would (v6only for ``::``)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((host, port))
    sock.listen()
    held.append(sock)


@pytest.mark.skipif(not ipv6_available(), reason="no IPv6 on this machine")
def test_port_held_only_on_ipv6_is_not_chosen(held: list[socket.socket]) -> None:
    port = free_ports(1)[0]
    assert is_bindable(port)
    hold(held, socket.AF_INET6, "::", port)
    # Free on IPv4, taken on ::, where TileRT binds dual-stack: not free.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("0.0.0.0", port))
    assert not is_bindable(port)
    assert choose_port(port) != port


def test_port_held_on_ipv4_loopback_is_not_chosen(held: list[socket.socket]) -> None:
    port = free_ports(1)[0]
    hold(held, socket.AF_INET, "127.0.0.1", port)
    assert not is_bindable(port)
    assert choose_port(port) > port


def test_choose_ports_distinct_and_skip_avoided() -> None:
    base = free_ports(1)[0]
    chosen = choose_ports({"http": base, "ctrl": base}, avoid={base})
    assert base not in chosen.values()
    assert len(set(chosen.values())) == 2
    assert all(is_bindable(p) for p in chosen.values())


def test_no_free_port_is_an_error() -> None:
    with pytest.raises(OSError, match="no free port"):
        choose_port(40000, avoid=set(range(40000, 40011)), limit=10)


def test_port_with_only_time_wait_connections_is_free() -> None:
    """After a server closed its connections (TIME_WAIT), engines can bind again: so can we."""
    (port,) = free_ports(1)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    listener.close()
    # The server's side closes first and sees the client's FIN after: it is in TIME_WAIT once
    # its recv returns EOF (each step waits for the one before; nothing is left to chance).
    conn.shutdown(socket.SHUT_WR)
    assert client.recv(1) == b""
    client.close()
    assert conn.recv(1) == b""
    conn.close()
    probe = socket.socket()  # a bind without SO_REUSEADDR fails: the TIME_WAIT entry is there
    try:
        with pytest.raises(OSError, match="in use"):
            probe.bind(("0.0.0.0", port))
    finally:
        probe.close()
    assert is_bindable(port)
    assert choose_port(port) == port


def test_listening_port_is_taken_even_with_reuseaddr(held: list[socket.socket]) -> None:
    """SO_REUSEADDR does not let the probe past a socket that listens on the port."""
    (port,) = free_ports(1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen()
    held.append(sock)
    assert not is_bindable(port)
