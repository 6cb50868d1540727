"""The direct-call server under abuse, on a real worker process: idle and excess connections, oversized
headers, a stopped worker behind a large send. Each case names the limit that handles it."""

import os
import signal
import socket
import threading
import time

import pytest
import torch

import rlnb
from rlnb.errors import RemoteTimeoutError
from rlnb.runtime import direct
from rlnb.testing import Echo


@pytest.fixture(scope="module")
def one_slot():
    with rlnb.Cluster(slots=1, gpus=False) as cluster:
        yield cluster


def _server_state(dask_worker) -> dict:
    """On the worker: its call server's live connections and the process's thread count."""
    server = direct._SERVERS[dask_worker.address]
    return {"connections": server.connections, "threads": threading.active_count()}


def _set_limits(token_timeout_s=None, env=None, log=False):
    """On the worker: change the server's limits (and optionally record its warnings)."""
    import logging

    if token_timeout_s is not None:
        direct.TOKEN_TIMEOUT_S = token_timeout_s
    os.environ.update(env or {})
    if log:
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        logging.getLogger("rlnb").addHandler(Keep())
        direct._test_records = records


def _records() -> list:
    return list(getattr(direct, "_test_records", []))


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_idle_and_excess_connections_are_capped_and_closed(one_slot):
    group = rlnb.Group.launch(Echo, one_slot, "0", name="idle")
    address = group._links[0].address
    before = one_slot.client.run(_server_state)
    one_slot.client.run(_set_limits, 2.0, {"RLNB_DIRECT_MAX_CONNECTIONS": "32"}, True)
    try:
        idle = [socket.create_connection(address, timeout=5) for _ in range(100)]  # no token, ever
        time.sleep(0.5)
        (during,) = one_slot.client.run(_server_state).values()
        assert during["connections"] <= 32  # the rest were closed on accept
        assert during["threads"] <= next(iter(before.values()))["threads"] + 32 + 4
        assert group.add(1).result(10) == [1]  # the driver's authenticated connection still works
        time.sleep(2.5)  # past the token timeout: every idle connection was closed by the worker
        assert all(_closed_by_peer(s) for s in idle)
        for s in idle:
            s.close()
        (after,) = one_slot.client.run(_server_state).values()
        assert after["connections"] <= 2
        (logged,) = one_slot.client.run(_records).values()
        assert sum("refusing more" in m for m in logged) == 1  # logged once, not 68 times
        assert sum("before authenticating" in m for m in logged) == 1
        assert group.add(2).result(10) == [2]
    finally:
        one_slot.client.run(_set_limits, direct.TOKEN_TIMEOUT_S, {"RLNB_DIRECT_MAX_CONNECTIONS": "256"})
        group.shutdown()


def test_an_oversized_header_is_refused_before_anything_is_allocated(one_slot, monkeypatch):
    group = rlnb.Group.launch(Echo, one_slot, "0", name="big")
    link = group._links[0]
    one_slot.client.run(_set_limits, None, {"RLNB_MAX_MESSAGE_BYTES": str(64 << 20)})
    try:
        sock = link.connect()
        # a request whose header announces a 1 GiB pickle, and then nothing
        sock.sendall(direct._REQ.pack(link.key.encode(), b"call") + direct._HEAD.pack(0, 1 << 30))
        sock.settimeout(10)
        payload, buffers = direct.recv_message(sock)  # the worker says why...
        status, value, _ = direct.loads(payload, buffers)
        assert status == "err" and value["type"] == "MessageTooLarge"
        assert "1,073,741,824 bytes" in value["message"] and "RLNB_MAX_MESSAGE_BYTES" in value["message"]
        assert sock.recv(1) == b""  # ...and closes the connection
        sock.close()
        # the driver checks its own messages before sending a byte
        monkeypatch.setenv("RLNB_MAX_MESSAGE_BYTES", str(1 << 20))
        with pytest.raises(direct.MessageTooLarge, match=r"big\.echo\(\).*RLNB_MAX_MESSAGE_BYTES"):
            group.echo(torch.zeros(1 << 20))
        monkeypatch.delenv("RLNB_MAX_MESSAGE_BYTES")
        assert group.add(3).result(10) == [3]
    finally:
        one_slot.client.run(_set_limits, None, {"RLNB_MAX_MESSAGE_BYTES": str(8 << 30)})
        group.shutdown()


def test_a_large_call_to_a_stopped_worker_ends_within_the_call_timeout(one_slot):
    group = rlnb.Group.launch(Echo, one_slot, "0", name="stopped", call_timeout_s=3.0)
    (pid,) = one_slot.client.run(os.getpid).values()
    big = torch.ones(16 << 20)  # 64 MiB: far more than the socket buffers hold
    outcome = {}

    def call():
        t0 = time.monotonic()
        try:
            group.echo(big).result()
        except Exception as e:
            outcome["error"] = e
        outcome["seconds"] = time.monotonic() - t0

    os.kill(pid, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), "the send blocked past the call timeout"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert isinstance(outcome["error"], RemoteTimeoutError), outcome
    assert "stopped[rank 0]" in str(outcome["error"]) and outcome["seconds"] < 10
    assert group.add(4).result(20) == [4]  # the worker resumed: a fresh connection works
    group.shutdown()
