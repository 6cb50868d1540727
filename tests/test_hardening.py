"""The direct-call server under abuse, on a real worker process: idle and excess connections, oversized
headers, a stopped worker behind a large send. Each case names the limit that handles it."""

import contextlib
import os
import signal
import socket
import threading
import time

import pytest
import torch

import rlnb
from rlnb.errors import RemoteTimeoutError
from rlnb.runtime import direct, wire
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
        # at most an eighth of the cap (4) authenticating at once: the oldest were closed to admit the newer
        assert during["connections"] <= 4 + 2
        assert during["threads"] <= next(iter(before.values()))["threads"] + 4 + 4
        assert group.add(1).result(10) == [1]  # the driver's authenticated connection still works
        fresh = rlnb.Group.launch(Echo, one_slot, "0", name="fresh")  # and a new one gets in
        assert fresh.add(3).result(10) == [3]
        fresh.shutdown()
        time.sleep(2.5)  # past the token timeout: every idle connection was closed by the worker
        assert all(_closed_by_peer(s) for s in idle)
        for s in idle:
            s.close()
        (after,) = one_slot.client.run(_server_state).values()
        assert after["connections"] <= 2
        (logged,) = one_slot.client.run(_records).values()
        assert sum("closing the oldest" in m for m in logged) == 1  # logged once, not 96 times
        assert sum("before authenticating" in m for m in logged) == 1
        assert group.add(2).result(10) == [2]
    finally:
        one_slot.client.run(_set_limits, direct.TOKEN_TIMEOUT_S, {"RLNB_DIRECT_MAX_CONNECTIONS": "256"})
        group.shutdown()


def test_a_token_sent_a_byte_at_a_time_does_not_keep_a_connection_open(one_slot):
    """The token deadline applied to each recv: one byte every 8 s kept a connection open indefinitely, and
    300 such connections filled the cap, so every new group, channel or driver failed on a live worker."""
    group = rlnb.Group.launch(Echo, one_slot, "0", name="loris")
    address = group._links[0].address
    one_slot.client.run(_set_limits, 1.5, {"RLNB_DIRECT_MAX_CONNECTIONS": "32"})
    try:
        # fewer than may authenticate at once, so none is closed to admit another
        slow = [socket.create_connection(address, timeout=5) for _ in range(3)]
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:  # a byte from each every 0.5 s: within any per-byte deadline
            for s in slow:
                with contextlib.suppress(OSError):
                    s.send(b"x")
            time.sleep(0.5)
        assert all(_closed_by_peer(s) for s in slow)  # closed after 1.5 s in all, bytes or not
        slow += [socket.create_connection(address, timeout=5) for _ in range(40)]  # more than the cap
        for s in slow[3:]:
            s.send(b"x")
        fresh = rlnb.Group.launch(Echo, one_slot, "0", name="after-loris")  # new connections still get in
        assert fresh.add(4).result(10) == [4] and group.add(5).result(10) == [5]
        fresh.shutdown()
        for s in slow:
            s.close()
    finally:
        one_slot.client.run(_set_limits, direct.TOKEN_TIMEOUT_S, {"RLNB_DIRECT_MAX_CONNECTIONS": "256"})
        group.shutdown()


def _slow_to_drop(delay_s, dask_worker=None):
    """On the worker: a closed connection's thread gives its place back ``delay_s`` late (as under load, where
    the thread of an evicted connection ran after the next accept); ``None`` undoes it."""
    server = direct._SERVERS[dask_worker.address]
    server.__dict__.pop("_drop", None)
    if delay_s is not None:
        drop = server._drop
        server._drop = lambda conn: (time.sleep(delay_s), drop(conn))


@contextlib.contextmanager
def _one_authenticating_at_once(one_slot, name: str, patch, delay_s: float):
    """A group on the worker whose server lets one connection authenticate at once (a cap of 8), with ``patch``
    applied on the worker (``patch(delay_s)``, undone after); yields the group, its address and a list for raw
    sockets (closed after)."""
    group = rlnb.Group.launch(Echo, one_slot, "0", name=name)
    one_slot.client.run(_set_limits, None, {"RLNB_DIRECT_MAX_CONNECTIONS": "8"})
    one_slot.client.run(patch, delay_s)
    raw: list[socket.socket] = []
    try:
        yield group, group._links[0].address, raw
    finally:
        one_slot.client.run(patch, None)
        for s in raw:
            s.close()
        one_slot.client.run(_set_limits, None, {"RLNB_DIRECT_MAX_CONNECTIONS": "256"})
        group.shutdown()


def test_connections_evicted_while_authenticating_make_room_at_once_not_when_their_thread_runs(one_slot):
    """Under load a driver's connection was refused as over the cap (a WorkerLostError on CI) by connections
    already evicted, their threads not yet run: an evicted connection gives its place back when evicted."""
    with _one_authenticating_at_once(one_slot, "evicting", _slow_to_drop, 5.0) as (_, address, raw):
        for _ in range(8):  # each evicts the one before it
            raw.append(socket.create_connection(address, timeout=5))
            time.sleep(0.05)
        fresh = rlnb.Group.launch(Echo, one_slot, "0", name="after-evictions")
        assert fresh.add(4).result(10) == [4]
        fresh.shutdown()


def _slow_to_read_tokens(delay_s, dask_worker=None):
    """On the worker: a new connection's thread reads its token ``delay_s`` late (as under load, where the
    thread had not run when the next connection was accepted); ``None`` undoes it."""
    server = direct._SERVERS[dask_worker.address]
    server.__dict__.pop("_recv_token", None)
    if delay_s is not None:
        recv_token = server._recv_token
        server._recv_token = lambda conn, deadline: (
            time.sleep(delay_s),
            recv_token(conn, deadline + delay_s),
        )[1]


def test_a_connection_whose_token_has_arrived_is_not_evicted_while_its_thread_is_yet_to_read_it(one_slot):
    """Under load the accept thread of the TCP socket, still working through a backlog of connections, evicted
    a driver's connection accepted on the Unix socket, token sent, thread not yet run (a WorkerLostError on
    CI): a connection is evicted only while its token has not all arrived."""
    with _one_authenticating_at_once(one_slot, "token-sent", _slow_to_read_tokens, 1.0) as (_, address, raw):
        fresh = rlnb.Group.launch(Echo, one_slot, "0", name="token-sent-fresh")
        reply = fresh.add(4)  # a new connection, its token sent at once, its thread a second late
        time.sleep(0.3)
        raw += [socket.create_connection(address, timeout=5) for _ in range(3)]  # no token, ever
        assert reply.result(10) == [4]
        time.sleep(0.3)
        assert _closed_by_peer(raw[0]) and _closed_by_peer(raw[1])  # the silent ones are still evicted
        fresh.shutdown()


def test_an_oversized_header_is_refused_before_anything_is_allocated(one_slot, monkeypatch):
    group = rlnb.Group.launch(Echo, one_slot, "0", name="big")
    link = group._links[0]
    one_slot.client.run(_set_limits, None, {"RLNB_MAX_MESSAGE_BYTES": str(64 << 20)})
    try:
        sock = link.connect()
        # a request whose header announces a 1 GiB pickle, and then nothing
        sock.sendall(wire._REQ.pack(link.key.encode(), b"call") + wire._HEAD.pack(0, 1 << 30))
        sock.settimeout(10)
        payload, buffers = wire.recv_message(sock)  # the worker says why...
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


# ---------------------------------------------------------------------------------- shared memory, channels
def _put_big(channel, value: float) -> str:
    """In a component: put a pooled-shared-memory tensor; return this process's segment files."""
    import glob

    channel.put(torch.full((1 << 18,), value))  # 1 MiB
    return sorted(glob.glob(f"/dev/shm/rlnb-ch-{os.getpid()}-*"))


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_segments_are_private_and_those_of_a_killed_worker_are_swept_when_it_restarts(tmp_path):
    dead, alive = (
        f"/dev/shm/rlnb-ch-{_dead_pid()}-feedfacecafe",
        f"/dev/shm/rlnb-ch-{os.getpid()}-0123456789ab",
    )
    for path in (dead, alive):
        with open(path, "wb") as f:
            f.write(b"\0" * 64)
    try:
        with rlnb.Cluster(slots=1, gpus=False) as cluster:
            group = rlnb.Group.launch(Echo, cluster, "0", name="producer")
            assert not os.path.exists(dead) and os.path.exists(alive)  # swept when rlnb set the worker up
            channel = rlnb.Channel.create(cluster, "private")
            (segment,) = group.apply(_put_big, channel, 1.0).result(30)[0]
            assert os.stat(segment).st_mode & 0o777 == 0o600  # the user's alone, like the checkpoint files
            (pid,) = cluster.client.run(os.getpid).values()
            os.kill(pid, signal.SIGKILL)  # the worker never unlinks its segment
            deadline = time.monotonic() + 60
            while os.path.exists(segment) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not os.path.exists(segment), "the restarted worker did not sweep its predecessor's segment"
        assert os.path.exists(alive)  # a live process's segment is never touched
    finally:
        for path in (dead, alive):
            if os.path.exists(path):
                os.unlink(path)


def test_a_workers_segments_are_unlinked_when_its_cluster_closes():
    """A worker's pooled segments go with a normal close, not only with the next worker's sweep (a SAC run's
    learner left its segment: the worker process ends without running its atexit handlers)."""
    with rlnb.Cluster(slots=1, gpus=False) as cluster:
        group = rlnb.Group.launch(Echo, cluster, "0", name="producer")
        channel = rlnb.Channel.create(cluster, "closing")
        (segments,) = group.apply(_put_big, channel, 2.0).result(30)
        assert segments and all(os.path.exists(p) for p in segments)
    assert not [p for p in segments if os.path.exists(p)], "the closed worker left its segments in /dev/shm"


def test_concurrent_senders_never_share_a_segment(one_slot):
    import sys

    channel = rlnb.Channel.create(one_slot, "concurrent")
    rounds, senders, bad = 150, 4, []

    def send(sender: int):
        for i in range(rounds):
            channel.put(torch.full((1 << 16,), float(sender * 1000 + i)), key=str(sender))

    def receive(sender: int):
        for i in range(rounds):
            t = channel.get(key=str(sender), timeout=60)
            if not (float(t.min()) == float(t.max()) == sender * 1000 + i):
                bad.append((sender, i, float(t.min()), float(t.max())))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show within a few rounds
    try:
        threads = [threading.Thread(target=f, args=(s,)) for s in range(senders) for f in (send, receive)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(interval)
    channel.close()
    assert not bad, f"{len(bad)} tensor(s) overwritten by another sender, e.g. {bad[:3]}"


def _blocked_get(channel):
    return channel.get(key="never", timeout=60)


def _bounded_put(channel):
    channel.put(1, key="late")


def test_closing_a_channel_wakes_its_readers_and_refuses_later_puts(one_slot):
    group = rlnb.Group.launch(Echo, one_slot, "0", name="reader")
    channel = rlnb.Channel.create(one_slot, "closing", maxsize=4)
    worker_reader = group.apply(_blocked_get, channel)  # blocked on a worker...
    here = {}

    def driver_reader():
        t0 = time.monotonic()
        try:
            channel.get(key="never", timeout=60)
        except Exception as e:
            here["error"], here["seconds"] = e, time.monotonic() - t0

    thread = threading.Thread(target=driver_reader)
    thread.start()  # ...and in the notebook
    time.sleep(1.0)
    t0 = time.monotonic()
    channel.close()
    with pytest.raises(rlnb.RemoteError, match="ChannelClosedError.*'closing'"):
        worker_reader.result(20)
    thread.join(20)
    assert isinstance(here.get("error"), rlnb.ChannelClosedError) and time.monotonic() - t0 < 10
    with pytest.raises(rlnb.ChannelClosedError, match="'closing' key 'late'"):
        channel.put(1, key="late")
    with pytest.raises(rlnb.RemoteError, match="ChannelClosedError"):
        group.apply(_bounded_put, channel).result(20)  # another handle, on a worker
    group.shutdown()


def test_embedded_workers_ignore_ctrl_c(one_slot):
    """Ctrl-C in a terminal reaches every process of its group; only the driver should act on it."""
    group = rlnb.Group.launch(Echo, one_slot, "0", name="interrupted")
    (pid,) = one_slot.client.run(os.getpid).values()
    os.kill(pid, signal.SIGINT)
    time.sleep(1.0)
    assert group.add(5).result(20) == [5]
    assert one_slot.client.run(os.getpid) == {group.infos[0].address: pid}  # the same process, not a restart
    group.shutdown()
