"""Direct calls (the ranks' own sockets) and zero-copy channel reads, against the Dask path."""

import gc
import glob
import os
import pickle
import socket
import sys
import threading
import time

import numpy as np
import pytest
import torch

import rlnb
from rlnb.runtime import direct, link, wire
from rlnb.testing import Echo


@pytest.fixture(scope="module")
def echo(cluster):
    g = rlnb.Group.launch(Echo, cluster, "0-1", kwargs={"offset": 5})
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def echo_dask(cluster):
    os.environ["RLNB_DIRECT_CALLS"] = "0"
    try:
        g = rlnb.Group.launch(Echo, cluster, "0-1", kwargs={"offset": 5})
    finally:
        del os.environ["RLNB_DIRECT_CALLS"]
    yield g
    g.shutdown()


def test_transport_is_direct_unless_turned_off(echo, echo_dask):
    assert echo.transport == "direct" and echo.on(1).transport == "direct"
    assert echo_dask.transport == "dask"
    for g in (echo, echo_dask):
        assert g.add(1).result(30) == [6, 6]
        assert [w["rank"] for w in g.whoami().result(30)] == [0, 1]


def test_both_transports_run_component_code_on_the_dask_actor_thread(echo, echo_dask):
    threads = echo.thread().result(30)
    assert all("Dask-Actor-Threads" in t for t in threads), threads
    assert threads == echo_dask.thread().result(30)  # the very same thread per worker


def _actor_thread(dask_worker):
    from rlnb.runtime import direct

    server = direct._SERVERS[dask_worker.address]
    executor = dask_worker.executors["actor"]
    return type(executor).__name__, executor is server.actor_thread, getattr(executor, "served", None)


def test_rank_calls_are_answered_on_the_actor_thread_itself(cluster, echo):
    """No hop from a connection's thread to the actor thread and back: the actor thread reads the
    request, runs it and sends the reply (each of those hops cost ~0.1 ms here)."""
    before = cluster.client.run(_actor_thread)
    for _ in range(20):
        echo.noop().result(30)
    after = cluster.client.run(_actor_thread)
    for address, (kind, is_servers, served) in after.items():
        assert kind == "ActorThread" and is_servers, address
        # (a loaded machine may find two requests waiting and answer both in one pass: at least one per pass)
        assert served > before[address][2], (address, before[address], served)
    # Dask's thread state, as an actor method has it: get_worker() and thread_state.actor
    assert echo.apply(_dask_thread_state).result(30) == [(s.address, True) for s in cluster.slots[:2]]


def _dask_thread_state():
    from distributed import get_worker
    from distributed.worker import thread_state

    return get_worker().address, getattr(thread_state, "actor", None)


def test_a_reply_not_read_yet_does_not_hold_the_actor_thread(echo):
    """A big reply the driver has not started reading fills the socket: a helper thread finishes
    sending it, and the actor thread answers the next call meanwhile."""
    big = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB, far more than a socket's buffer
    pending = echo.on(0).echo(big)  # not read yet
    time.sleep(0.5)
    t0 = time.perf_counter()
    assert echo.on(0).add(1).result(10) == [6]  # answered while the reply above waits
    assert time.perf_counter() - t0 < 5
    assert torch.equal(pending.result(60)[0], big)
    assert echo.on(0).add(2).result(10) == [7]  # and its connection serves again


def test_a_worker_whose_actor_thread_already_ran_keeps_it_and_hops_to_it():
    """A Dask actor called before rlnb set up its worker plugin (a shared cluster): its thread is
    kept, so that actor never sees a second thread, and direct calls reach that same thread."""
    with rlnb.Cluster(slots=1, gpus=False) as cl:
        plain = cl.client.submit(Echo, actor=True, pure=False).result(30)
        first = plain.thread().result(30)
        g = rlnb.Group.launch(Echo, cl, "0", kwargs={"offset": 1})
        assert g.transport == "direct" and g.add(1).result(30) == [2]
        assert g.thread().result(30) == [first] == [plain.thread().result(30)]
        kind, is_servers, _ = next(iter(cl.client.run(_actor_thread).values()))
        assert kind == "ThreadPoolExecutor" and not is_servers
        g.shutdown()


def test_a_big_request_to_a_busy_rank_does_not_hold_the_driver(echo):
    """A request larger than a socket's buffer is read by the worker while its rank is still busy,
    so sending it neither waits for the rank nor holds up the other ranks' requests."""
    big = torch.ones(16 << 20, dtype=torch.uint8)  # 16 MiB
    both = [echo.on(0).noop(), echo.on(0).noop()]  # two connections to rank 0, both idle after this
    assert [b.result(30) for b in both] == [[None], [None]]
    busy = echo.on(0).sleep(3)
    time.sleep(0.2)
    t0 = time.perf_counter()
    pending = echo.echo(big)  # rank 0 is busy for ~3 s more; rank 1 is free
    sent_s = time.perf_counter() - t0
    assert sent_s < 1.5, f"sending took {sent_s:.1f} s: it waited for the busy rank"
    busy.result(30)
    assert all(torch.equal(x, big) for x in pending.result(60))


def _request(key: str, method: str, *args) -> bytes:
    parts = [wire._REQ.pack(key.encode(), b"call"), *direct.dumps((method, args, {}))]
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


def test_a_request_that_stops_arriving_does_not_hold_the_actor_thread(echo):
    """A client stopping halfway through a request (stopped, or a broken network) is read on a
    thread of its own; the rank's other callers are answered meanwhile."""
    link = echo._links[0]
    with socket.create_connection(link.address, timeout=10) as raw:  # (over TCP, as from another host)
        raw.sendall(link.token + _request(link.key, "add", 1))
        assert wire.recv_message(raw)  # answered: the connection now waits on the actor thread
        whole = _request(link.key, "add", 2)
        raw.sendall(whole[: len(whole) - 5])  # all but the last 5 bytes
        time.sleep(0.3)
        t0 = time.perf_counter()
        assert echo.on(0).add(3).result(10) == [8]
        assert time.perf_counter() - t0 < 5
        raw.sendall(whole[-5:])  # the rest arrives: the request is answered
        payload, buffers = wire.recv_message(raw)
        assert direct.loads(payload, buffers)[:2] == ("ok", 7)


def _raw_request(key: str, op: str, args: tuple) -> bytes:
    parts = [wire._REQ.pack(key.encode(), op.encode()), *direct.dumps(args)]
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


def test_requests_arriving_back_to_back_are_each_read_once_and_in_order(cluster):
    """A channel's connection carries puts back to back: the worker reads whatever has arrived in one
    go and keeps what is past a request for the next, big items (read straight into place) included."""
    ch = rlnb.Channel.create(cluster, "back_to_back", maxsize=0)
    ip, port, token, key, _unix = ch._direct
    big = np.arange(300_000, dtype=np.float32)  # 1.2 MB: bigger than one read
    items = [{"i": 0}, {"i": 1}, big, {"i": 3}, "x" * 70_000]
    stream = token + b"".join(_raw_request(key, "put", ("k", item, 10.0)) for item in items)
    with socket.create_connection((ip, port), timeout=30) as raw:
        raw.sendall(stream)  # all five requests in one send
        replies = [direct.loads(*wire.recv_message(raw)) for _ in items]
    assert [r[:2] for r in replies] == [("ok", ("ok", n)) for n in range(1, 6)]
    got = ch.get_batch(5, key="k", timeout=10)
    assert got[0] == {"i": 0} and got[1] == {"i": 1} and got[3] == {"i": 3} and got[4] == "x" * 70_000
    assert np.array_equal(got[2], big)
    ch.close()


def test_replies_read_later_arrive_in_order_when_many_come_in_one_read(cluster):
    """A channel's puts are sent now and their replies read later: one read may take in many
    replies at once, and each later one comes from what was kept, not from waiting on the socket."""
    ch = rlnb.Channel.create(cluster, "later", maxsize=0)
    sender = direct.OrderedSender(direct.link_for(ch._direct))
    try:
        for i in range(40):
            assert sender.send("put", ("k", i, 10.0), 10.0) == []
        time.sleep(0.5)  # every reply is in the socket by now
        replies = sender.drain(1.0)
        assert [r[:2] for r in replies] == [("ok", ("ok", n)) for n in range(1, 41)]
        assert sender.unread == 0 and ch.get_batch(40, key="k", timeout=10) == list(range(40))
    finally:
        sender.close()
        ch.close()


def test_the_buffered_reader_keeps_what_is_past_a_request():
    a, b = socket.socketpair()
    with a, b:
        reqs = [_raw_request("k" * 32, "put", (i, "y" * (i * 40_000))) for i in range(4)]
        sender = threading.Thread(target=a.sendall, args=(b"".join(reqs),))  # (more than the socket holds)
        sender.start()
        reader = direct._Reader(b, b"", None, buffered=True)
        for i in range(4):
            key, op, payload, buffers = direct._read_request(reader)
            assert (key, op) == ("k" * 32, "put") and direct.loads(payload, buffers) == (
                i,
                "y" * (i * 40_000),
            )
        assert reader.leftover() == 0
        sender.join(10)


def test_a_driver_on_the_workers_host_connects_over_a_unix_socket(echo, monkeypatch):
    link = echo._links[0]
    assert link.unix_name and link.unix_name.startswith("rlnb-direct-")
    with link.connect() as sock:
        assert sock.family == socket.AF_UNIX
    monkeypatch.setenv("RLNB_DIRECT_UNIX", "0")  # turned off: TCP
    off = direct.DirectLink(*link.address, link.token, link.key, link.unix_name)
    elsewhere = direct.DirectLink(*link.address, link.token, link.key, "rlnb-direct-no-such-socket")
    monkeypatch.delenv("RLNB_DIRECT_UNIX")
    for other in (off, elsewhere):  # the name is not found here (another host): TCP, and it works
        with other.connect() as sock:
            assert sock.family in (socket.AF_INET, socket.AF_INET6)
        assert other.send("call", ("add", (4,), {}), 10).read()[:2] == ("ok", 9)
        other.close()
    assert elsewhere.unix_name is None  # tried once


def _tensors():
    big = torch.randn(512, 300)  # 600 KiB: travels out of band
    return {
        "big": big,
        "strided": big.t(),  # not contiguous
        "bf16": torch.randn(300, 256).to(torch.bfloat16),
        "ints": torch.arange(100_000, dtype=torch.int64).view(1000, 100),
        "small": torch.tensor([1.5, -2.0]),
        "empty": torch.zeros(0, 3),
        "grad": torch.ones(3, requires_grad=True),
        "array": np.arange(200_000, dtype=np.float32).reshape(400, 500),
        "nested": [{"x": torch.full((128, 1024), 7.0)}, ("text", 3)],
    }


def _assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
        assert torch.equal(a.detach(), b.detach())
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("transport", ["direct", "dask"])
def test_tensors_and_arrays_round_trip_exactly(transport, echo, echo_dask):
    g = echo if transport == "direct" else echo_dask
    sent = _tensors()
    if transport == "dask":
        del sent["bf16"]  # Dask's own serialisation cannot send bfloat16 tensors; the direct path can
    for got in g.echo(sent).result(60):
        _assert_same(sent, got)


def test_encoding_keeps_big_tensors_out_of_the_pickle():
    t = torch.randn(256, 256)
    parts = direct.dumps({"t": t})
    _head, payload, *buffers = parts
    assert len(buffers) == 1 and memoryview(buffers[0]).nbytes == t.numel() * 4
    assert memoryview(payload).nbytes < 1000
    out = direct.loads(payload, [bytearray(b) for b in buffers])
    assert torch.equal(out["t"], t)


def test_in_process_copy_is_independent_and_main_objects_use_cloudpickle():
    big, small = torch.zeros(256, 256), torch.zeros(3)
    out = direct.copy_by_pickle({"big": big, "small": small, "arr": np.zeros(100_000)})
    big += 1
    small += 1
    assert float(out["big"].sum()) == 0 and float(out["small"].sum()) == 0  # copies, not views
    out["big"] += 2  # and writable
    assert float(big[0, 0]) == 1

    class Local:  # plain pickle cannot send this (a local class): cloudpickle does
        pass

    assert type(direct.copy_by_pickle(Local())).__name__ == "Local"


def test_notebook_functions_and_classes_travel_by_value(echo):
    class Scaler:  # defined here, unknown to the workers by import
        def __init__(self, k):
            self.k = k

    offset = 3
    assert echo.apply(lambda s: s.k * 2 + offset, Scaler(10)).result(30) == [23, 23]


def test_unsendable_argument_and_result_are_clear_errors(echo):
    import threading

    with pytest.raises(TypeError, match=r"echo\.echo\(\): an argument cannot be sent"):
        echo.echo(threading.Lock())
    with pytest.raises(rlnb.RemoteError, match="could not be sent back") as e:
        echo.on(1).unpicklable().result(30)
    assert (e.value.component, e.value.rank) == ("echo", 1)
    assert echo.add(1).result(30) == [6, 6]  # the connections are still usable


def test_direct_port_refuses_a_wrong_token(echo):
    import time

    link = echo._links[0]
    request = (
        b"\0" * direct.TOKEN_BYTES  # not the token
        + wire._REQ.pack(link.key.encode(), b"call")
        + b"".join(direct.dumps(("sleep", (3.0,), {})))
    )
    with socket.create_connection(link.address, timeout=5) as s:
        s.settimeout(5)
        try:
            s.sendall(request)
            assert s.recv(1) == b""  # closed
        except ConnectionResetError:
            pass  # closed while we were still sending
    t0 = time.perf_counter()
    assert echo.on(0).add(0).result(30) == [5]
    assert time.perf_counter() - t0 < 1.5  # the rank never ran the 3 s sleep


def test_channel_reader_keeps_what_it_holds_and_frees_what_it_drops(cluster):
    ch = rlnb.Channel.create(cluster, "leases")
    n = 1 << 20  # 4 MiB of float32: pooled shared memory
    mine = f"/dev/shm/rlnb-ch-{os.getpid()}-*"
    before = set(glob.glob(mine))
    ch.put(torch.full((n,), 1.0))
    a = ch.get(timeout=10)  # a zero-copy view: its segment stays taken while `a` lives
    ch.put(torch.full((n,), 2.0))
    b = ch.get(timeout=10)
    assert float(a.min()) == float(a.max()) == 1.0  # not overwritten by the second put
    assert float(b.min()) == float(b.max()) == 2.0
    view = a[10:20]  # a view keeps the segment too
    segments = set(glob.glob(mine)) - before
    assert a.data_ptr() != b.data_ptr() and len(segments) <= 2  # (earlier tests may have left free ones)
    segments = set(glob.glob(mine))
    del a, b
    gc.collect()
    ch.put(torch.full((n,), 3.0))  # reuses the segment `b` had: no new file
    c = ch.get(timeout=10)
    assert float(c[0]) == 3.0 and float(view[0]) == 1.0
    assert set(glob.glob(mine)) == segments
    del c, view
    ch.close()


def test_channel_ops_work_over_both_transports(cluster):
    ch = rlnb.Channel.create(cluster, "both", maxsize=1)
    assert ch._direct is not None
    os.environ["RLNB_DIRECT_CALLS"] = "0"  # read when a handle picks its route (once, on first use)
    try:
        on_dask = pickle.loads(pickle.dumps(ch))  # a handle as a component receives it
        on_dask.put({"a": torch.arange(4)}, key="k")
        with pytest.raises(rlnb.ChannelTimeoutError, match="queue stayed full"):
            on_dask.put(1, key="k", timeout=0.2)
        assert type(on_dask._route_cache).__name__ == "_DaskChannelRoute"
    finally:
        del os.environ["RLNB_DIRECT_CALLS"]
    assert ch._route_cache is None  # not pickled along: each process chooses
    with pytest.raises(rlnb.ChannelTimeoutError, match="queue stayed full"):
        ch.put(1, key="k", timeout=0.2)
    assert ch.qsize("k") == 1 and ch.keys() == ["k"]
    assert torch.equal(ch.get(key="k", timeout=5)["a"], torch.arange(4))
    with pytest.raises(rlnb.ChannelTimeoutError, match="waited 0.2 s"):
        ch.get(key="k", timeout=0.2)
    assert ch.stats()["items"] == 1
    assert type(ch._route_cache).__name__ == "_DirectChannelRoute"


def test_workers_reuse_freed_memory_instead_of_mapping_each_tensor(echo):
    """Dask's nanny sets MALLOC_TRIM_THRESHOLD_, so each big tensor would be a fresh mmap; ranks undo it."""
    import subprocess
    import sys

    code = "from rlnb.testing import mmapped_bytes_of_an_8mib_tensor as f; print(f())"
    tuning = ("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD")  # (a machine's own allocator settings, left out)
    env = {k: v for k, v in os.environ.items() if not k.startswith(tuning)}
    env["MALLOC_TRIM_THRESHOLD_"] = "65536"  # what a Dask worker starts with
    untuned = max(  # (three tries: another allocation of the process may land between the counts once)
        int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout)
        for _ in range(3)
    )
    assert untuned >= 8 << 20  # the check can tell: a fresh mapping for the tensor
    assert echo.mmapped_bytes_of_an_8mib_tensor().result(30) == [0, 0]


def test_calls_work_with_file_descriptors_above_1024(cluster):
    """A long notebook session can hold many files; select() would fail past fd 1023, poll() does not."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1400:
        pytest.skip("the open-file limit is too low to get a descriptor above 1024")
    pipes = [os.pipe() for _ in range(600)]
    try:
        g = rlnb.Group.launch(Echo, cluster, "0-1")
        socks = [link.connect() for link in g._links]
        assert min(s.fileno() for s in socks) > 1024  # what the calls below get too
        for s in socks:
            s.close()
        assert g.add(2).result(30) == [2, 2]
        ch = rlnb.Channel.create(cluster, "many-fds", slot=1)
        ch.put("x")
        assert ch.get(timeout=10) == "x"
        g.shutdown()
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)


def _hosts_served() -> int:
    from rlnb.runtime import direct as d

    return sum(len(s.hosts) for s in d._SERVERS.values())


def test_a_group_dropped_without_shutdown_is_freed_on_its_workers(cluster):
    import time

    before = cluster.client.run(_hosts_served)
    g = rlnb.Group.launch(Echo, cluster, "0-1")
    assert g.noop().result(30) == [None, None]
    during = cluster.client.run(_hosts_served)
    assert all(during[a] == before[a] + 1 for a in before)
    for info in g.infos:
        cluster.unregister_component(f"{g.name}[{info.rank}]")
    del g
    gc.collect()
    deadline = time.monotonic() + 15
    while cluster.client.run(_hosts_served) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.client.run(_hosts_served) == before  # Dask released the actors; the call servers let go


def test_cluster_close_closes_the_drivers_channel_sockets():
    from rlnb.runtime import channel as c
    from rlnb.runtime import link as d

    with rlnb.Cluster(slots=1, gpus=False) as cl:
        ch = rlnb.Channel.create(cl, "bye")
        for i in range(3):
            ch.put(i)
        assert ch.get_batch(3, timeout=10) == [0, 1, 2]
        assert tuple(ch._direct) in d._LINKS and ch._direct in c._SENDERS
    assert tuple(ch._direct) not in d._LINKS and ch._direct not in c._SENDERS


def test_channel_falls_back_to_dask_when_its_direct_port_is_unreachable(cluster, monkeypatch):
    """A firewall that drops packets to the direct port (simulated: a full accept queue) -> Dask's rpc."""
    from rlnb.runtime import channel as c

    monkeypatch.setattr(link, "CONNECT_TIMEOUT_S", 0.5)
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    held = socket.create_connection(blackhole.getsockname(), timeout=1)  # fills the queue
    try:
        ch = rlnb.Channel.create(cluster, "firewalled", maxsize=0)
        _, _, token, key, _unix_name = ch._direct
        ch._direct = ("127.0.0.1", blackhole.getsockname()[1], token, key, None)  # (as from another host)
        ch.put({"x": 1})  # an unbounded put: the ordered sender finds the port unreachable
        ch.put({"x": 2})
        assert ch._direct in c._UNREACHABLE
        assert ch.get_batch(2, timeout=10) == [{"x": 1}, {"x": 2}]  # both arrived, through Dask
        assert ch.qsize() == 0
    finally:
        held.close()
        blackhole.close()


def test_group_launch_falls_back_to_dask_when_ranks_are_unreachable(cluster, monkeypatch):
    def no_route(self, timeout_s=None):
        raise direct.Unreachable("simulated: no route to the direct port")

    monkeypatch.setattr(direct.DirectLink, "connect", no_route)
    g = rlnb.Group.launch(Echo, cluster, "0-1", kwargs={"offset": 1})
    try:
        assert g.transport == "dask"
        assert g.add(1).result(30) == [2, 2]
    finally:
        g.shutdown()


def test_direct_port_range_from_the_environment(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    monkeypatch.setenv("RLNB_DIRECT_PORTS", f"{base}-{base + 5}")
    first = direct._listen("127.0.0.1", socket.AF_INET)
    second = direct._listen("127.0.0.1", socket.AF_INET)  # the first port is taken now
    try:
        ports = [first.getsockname()[1], second.getsockname()[1]]
        assert base <= ports[0] < ports[1] <= base + 5
    finally:
        first.close()
        second.close()
    monkeypatch.setenv("RLNB_DIRECT_PORTS", "91OO-9199")
    with pytest.raises(ValueError, match="RLNB_DIRECT_PORTS: expected a port or a range"):
        direct._listen("127.0.0.1", socket.AF_INET)


def test_objects_defined_in_main_travel_by_value():
    """What a notebook defines lives in ``__main__``, which a worker does not have."""
    import sys

    main = sys.modules["__main__"]

    def plus_one(x):
        return x + 1

    plus_one.__module__, plus_one.__qualname__ = "__main__", "rlnb_test_plus_one"
    main.rlnb_test_plus_one = plus_one  # so the standard pickler would send it by reference
    try:
        _head, payload, *buffers = direct.dumps(plus_one)
    finally:
        del main.rlnb_test_plus_one  # as in a worker: no such name in its __main__
    assert direct.loads(payload, buffers)(1) == 2


def test_process_group_across_a_direct_and_a_dask_group(cluster, monkeypatch):
    """One call cannot mix transports: init_collective then uses Dask's rpc for every rank."""
    from rlnb.testing import Collective

    actor = rlnb.Group.launch(Collective, cluster, "0", name="actor")
    monkeypatch.setenv("RLNB_DIRECT_CALLS", "0")
    rollout = rlnb.Group.launch(Collective, cluster, "1", name="rollout")
    monkeypatch.delenv("RLNB_DIRECT_CALLS")
    try:
        assert (actor.transport, rollout.transport) == ("direct", "dask")
        assert rlnb.init_collective([actor, rollout], name="mixed") == "gloo"
        actor.set_weights(1.5).result(30)
        send, recv = actor.broadcast_weights(0, "mixed"), rollout.broadcast_weights(0, "mixed")
        expected = {"weight": [[1.5] * 3] * 2, "bias": [1.5, 1.5]}
        assert send.result(60) == recv.result(60) == [expected]
    finally:
        actor.shutdown()
        rollout.shutdown()


def test_modules_registered_by_value_travel_by_value_on_both_routes(echo, echo_dask, tmp_path, monkeypatch):
    """``cloudpickle.register_pickle_by_value``: the workers do not have the module, the driver does."""
    import importlib

    import cloudpickle

    (tmp_path / "only_here.py").write_text("def triple(x):\n    return 3 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("only_here")
    cloudpickle.register_pickle_by_value(module)
    try:
        for group in (echo, echo_dask):
            assert group.apply(module.triple, 2).result(20) == [6, 6], group.transport
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        sys.modules.pop("only_here", None)
