"""Engine port choice on a node."""

import socket

import pytest

from llmgw.errors import EngineLaunchError
from tests.harness import free_port
from worker_agent.launch import pick_port


def _time_wait_on(port: int) -> None:
    """Leave the server side of a closed connection in TIME_WAIT on ``port``."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = server.accept()
            conn.close()  # the server closes first: its side lingers in TIME_WAIT
            client.recv(1)


def test_a_port_whose_last_engine_left_time_wait_behind_is_free() -> None:
    port = free_port()
    _time_wait_on(port)
    assert pick_port("127.0.0.1", [port], set()) == port


def test_a_listening_port_or_a_used_one_is_skipped() -> None:
    taken, free = free_port(), free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        assert pick_port("127.0.0.1", [taken, free], set()) == free
        with pytest.raises(EngineLaunchError, match="no free port"):
            pick_port("127.0.0.1", [taken, free], {free})
