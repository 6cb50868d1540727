"""A run's driver steered from another process: detached runs found, attached and steered from any notebook or
terminal of the machine (``rlnb.attach``, ``rlnb ps`` / ``attach`` / ``stop``), as tmux's attach or ``ray attach``.

A driver serves its run on a loopback port (:class:`ControlServer`); ``<run_dir>/control.json`` (``0600`` in the
run's ``0700`` directory) says where, with a random token that every request carries: only the run's owner, who
can read that file, steers it. With ``runner.control: network`` it serves on every interface of its host, over
TLS with a certificate made for the run (its private key never leaves the driver's memory; the certificate, in
``control.json``, is what a client trusts), so that other hosts reading the run directory on a shared file system
attach too. Requests and replies are one JSON object a line.

    >>> run = rlnb.attach("runs/ppo_cartpole-20261129-081500")                    # doctest: +SKIP
    >>> run.pause(); run.set_hyperparameters(lr=1e-4); run.unpause()             # doctest: +SKIP
    >>> run.wait()                                                                # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from rlnb.errors import ConfigError, RlnbError

log = logging.getLogger("rlnb")

CONTROL_FILE = "control.json"
"""Where a live driver says how to reach it, in its run directory."""
REQUEST_BYTES = 1 << 16
"""The longest request a driver reads (a line of JSON)."""
CALL_TIMEOUT_S = 30.0
"""How long a request to a driver may take, its reply included."""
HANDSHAKE_TIMEOUT_S = 5.0
"""How long a driver served on the network waits for a connection's TLS handshake."""


class RunNotLiveError(RlnbError):
    """The run directory has no live driver to steer (it ended, or never served one)."""


class ControlServer:
    """Serves ``loop``'s steering to other processes of its user (see the module's docstring): ``status``,
    ``pause``, ``unpause``, ``stop``, ``save``, ``set`` (hyperparameters). A thread of its own; requests act at the
    loop's next step boundary as the dashboard's controls do."""

    def __init__(self, loop, run_dir: str | os.PathLike, network: bool | None = None):

        self.loop, self.run_dir = loop, Path(run_dir)
        self.token = secrets.token_hex(32)
        if network is None:
            network = loop.recipe.runner.control == "network"
        served = {}
        self.tls = None
        if network:  # every interface, over TLS: the certificate in control.json is what clients trust
            cert, self.tls = _tls_server_context()
            served = {"addresses": _host_addresses(), "cert": cert}
        # (accept blocks: close() shuts it down)
        self.sock = socket.create_server(("0.0.0.0" if network else "127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.outcome: str | None = None
        self._closed = threading.Event()
        _write_control(
            self.run_dir,
            {
                "port": self.port,
                "token": self.token,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "recipe": loop.recipe.name,
                "started": time.time(),
                **served,
            },
        )
        self.thread = threading.Thread(target=self._serve, name="rlnb-control", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:  # (shut down by close(); else a connection reset before it was taken)
                continue
            if self.tls is not None:  # (a handshake of its own deadline: anyone on the network can connect)
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except OSError:  # (not TLS, or not finished within the deadline)
                    conn.close()
                    continue
            conn.settimeout(CALL_TIMEOUT_S)
            with conn:
                try:
                    request = json.loads(_read_line(conn))
                    reply = self._answer(request)
                except Exception as e:  # a bad request is answered, never ends the server
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                with contextlib.suppress(OSError):  # (a client gone before its reply)
                    conn.sendall((json.dumps(reply) + "\n").encode())

    def _answer(self, request: dict) -> dict:
        if not isinstance(request, dict) or not hmac.compare_digest(
            str(request.get("token", "")), self.token
        ):
            return {"ok": False, "error": "refused: not this run's token"}
        loop, op = self.loop, request.get("op")
        if op == "pause":
            loop.pause()
        elif op == "unpause":
            loop.unpause()
        elif op == "stop":
            loop.stop()
            loop.unpause()  # (a paused run ends too)
        elif op == "save":
            loop.request_save()
        elif op == "set":
            loop.set_hyperparameters(**dict(request.get("values") or {}))
        elif op == "sample":
            n = request.get("n", 4)
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
                return {"ok": False, "error": f"sample: n: expected an integer in [1, 1024], got {n!r}"}
            got = loop.steer.between_steps(lambda: _sample(loop, n), CALL_TIMEOUT_S / 2)
            return {"ok": True, "sample": _encode(got)}
        elif op != "status":
            return {"ok": False, "error": f"unknown op {op!r}"}
        return {"ok": True, "step": loop.step, "total": loop.recipe.runner.steps, "paused": loop.paused,
                "held": loop.steer.holding, "stopping": loop.stopped, "outcome": self.outcome}  # fmt: skip

    def close(self, outcome: str | None = None) -> None:
        """Stop serving, and leave ``control.json`` saying how the run ended (``outcome``)."""

        self.outcome = outcome
        # the outcome written before the port closes: a client that finds no driver then always reads how it ended
        # (`rlnb stop` read "unknown" in CI when the file came after)
        with contextlib.suppress(OSError):  # (a full disk: the run's end is in its metrics all the same)
            _write_control(self.run_dir, {"pid": os.getpid(), "outcome": outcome, "ended": time.time()})
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # (wakes the blocked accept on Linux)
        self.thread.join(5)
        self.sock.close()


def _tls_server_context():
    """``(certificate PEM, server SSLContext)``: a self-signed certificate and key made for this run (ECDSA P-256,
    valid 30 days); the key is loaded from a private temporary file, removed at once."""
    import datetime
    import ssl
    import tempfile

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlnb run control")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    pem = cert.public_bytes(serialization.Encoding.PEM)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory() as tmp:  # (0700: the key readable by this user for an instant)
        cert_file, key_file = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert_file.write_bytes(pem)
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        context.load_cert_chain(cert_file, key_file)
    return pem.decode(), context


def _host_addresses() -> list[str]:
    """This host's IPv4 addresses but loopback's: where another host may reach the driver."""
    import psutil

    found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family == socket.AF_INET and not a.address.startswith("127.")]  # fmt: skip
    return found or ["127.0.0.1"]


def _connect(found: dict) -> socket.socket:
    """A connection to the driver ``control.json`` describes: its loopback port, or (served on the network) each of
    its host's addresses in turn, over TLS trusting the run's certificate alone."""
    if "cert" not in found:
        return socket.create_connection(("127.0.0.1", found["port"]), timeout=CALL_TIMEOUT_S)
    import ssl

    context = ssl.create_default_context(cadata=found["cert"])
    context.check_hostname = False  # (the pinned certificate is the identity: its addresses may change)
    last: OSError | None = None
    for address in [
        "127.0.0.1",
        *found.get("addresses", []),
    ]:  # (another host's loopback is refused, or not TLS)
        raw = None
        try:
            raw = socket.create_connection((address, found["port"]), timeout=min(5.0, CALL_TIMEOUT_S))
            raw.settimeout(CALL_TIMEOUT_S)
            return context.wrap_socket(raw)
        except OSError as e:  # (ssl.SSLError is one)
            last = e
            if raw is not None:
                raw.close()
    raise last or OSError("no address to reach the driver")


def _write_control(run_dir: Path, found: dict) -> None:
    """``control.json`` replaced whole (``0600``): a reader never sees it half written."""
    from rlnb.files import write_private

    tmp = run_dir / f".{CONTROL_FILE}.{os.getpid()}.tmp"
    write_private(tmp, json.dumps(found))
    os.replace(tmp, run_dir / CONTROL_FILE)  # (replaces a link planted there, never writes through it)


def read_control(run_dir: str | os.PathLike) -> dict:
    """The run's ``control.json``: where its driver serves it (``port``, ``token``, ``pid``), or how it ended
    (``outcome``). Read without following a link.

    Raises:
        FileNotFoundError: no driver ever served the run.
        ValueError: the file is not JSON (being written, or not rlnb's).
    """
    from rlnb.files import read_text_regular

    found = json.loads(read_text_regular(Path(run_dir) / CONTROL_FILE, 4096, follow=False))
    if not isinstance(found, dict):
        raise ValueError(f"{CONTROL_FILE} holds no object")
    return found


def _sample(loop, n: int):
    """What the loop shows of its batch (``loop.sample``): an embodied loop's first ``n`` time steps, an LM loop's
    first group of completions."""
    return loop.sample(n)


def _encode(value):
    """``value`` as JSON can carry it: arrays and tensors as their bytes (base64), dtype and shape, read back by
    :func:`_decode` (no pickle: nothing in a reply runs code)."""
    import base64

    import numpy as np

    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":  # (strings, objects: as lists)
            return value.tolist()
        data = np.ascontiguousarray(value)
        return {"__ndarray__": base64.b64encode(data.tobytes()).decode(), "dtype": data.dtype.str,
                "shape": list(data.shape)}  # fmt: skip
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _decode(value):
    import base64

    import numpy as np

    if isinstance(value, dict) and "__ndarray__" in value:
        dtype = np.dtype(value["dtype"])
        if dtype.kind not in "biuf":
            raise ValueError(f"an array of dtype {dtype} in a reply")
        return (
            np.frombuffer(base64.b64decode(value["__ndarray__"]), dtype=dtype).reshape(value["shape"]).copy()
        )
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > REQUEST_BYTES:
            raise ValueError(f"a request longer than {REQUEST_BYTES} bytes")
    return data.decode()


class AttachedRun:
    """A live run of another process (:func:`attach`): its metrics so far, its state, and the steering the
    dashboard's controls give (pause, stop, save now, hyperparameters), each acting at its next step boundary.
    ``dashboard()`` shows it live."""

    def __init__(self, run_dir: str | os.PathLike):
        from rlnb.config import load_recipe

        self.run_dir = Path(run_dir)
        if not (self.run_dir / "recipe.yaml").is_file():
            raise ConfigError(f"run_dir: {self.run_dir} is not a run directory (no recipe.yaml)", "run_dir")
        self.recipe = load_recipe(self.run_dir / "recipe.yaml", check=False)  # (read, not validated: it ran)
        self.status()  # (refused here if no driver serves it)

    def _control(self) -> dict:
        try:
            found = read_control(self.run_dir)
        except FileNotFoundError:
            raise RunNotLiveError(f"{self.run_dir}: no driver serves this run (no {CONTROL_FILE})") from None
        if "port" not in found:
            raise RunNotLiveError(
                f"{self.run_dir}: the run ended ({found.get('outcome') or 'its driver exited'})"
            )
        return found

    def _call(self, op: str, **fields) -> dict:
        found = self._control()
        try:
            with _connect(found) as conn:
                conn.sendall((json.dumps({"token": found["token"], "op": op, **fields}) + "\n").encode())
                reply = json.loads(_read_line(conn) or "{}")
        except OSError as e:
            raise RunNotLiveError(
                f"{self.run_dir}: its driver (pid {found.get('pid')}) does not answer ({e})"
            ) from None
        if not reply.get("ok"):
            raise RlnbError(f"{self.run_dir}: {op}: {reply.get('error', 'no reply')}")
        return reply

    # ------------------------------------------------------------------ what the dashboard's controls call
    @property
    def step(self) -> int:
        return self.status()["step"]

    def status(self) -> dict:
        """``step``, ``total``, ``paused`` (asked to), ``held`` (paused, and holding at a step boundary now: the
        steps its worker ran ahead when the pause came are taken first), ``stopping`` and ``outcome`` of the run
        now."""
        return self._call("status")

    def pause(self) -> None:
        self._call("pause")

    def unpause(self) -> None:
        self._call("unpause")

    def stop(self) -> None:
        """End the run at its next step boundary, with a checkpoint (a paused run too)."""
        self._call("stop")

    def request_save(self) -> None:
        self._call("save")

    def sample(self, n: int = 4):
        """What the run's loop shows of its current batch, taken by its driver between two steps: an embodied run's
        first ``n`` time steps (``loop.sample(n)``: arrays by name), an LM run's first group of completions
        (``loop.sample_group(0)``)."""
        return _decode(self._call("sample", n=n)["sample"])

    def set_hyperparameters(self, **values: float) -> dict:
        """As :meth:`rlnb.Loop.set_hyperparameters`, on the run's driver (checked there, applied at its next step)."""
        return self._call("set", values=values)

    # ------------------------------------------------------------------ following it
    @property
    def history(self) -> list[dict]:
        """The run's metric records so far (its ``metrics.jsonl``)."""
        from rlnb.metrics import read_metrics

        return read_metrics(self.run_dir)

    def live(self) -> bool:
        """Whether a driver still serves the run."""
        try:
            self.status()
        except RunNotLiveError:
            return False
        return True

    def wait(self, timeout_s: float | None = None, poll_s: float = 0.5) -> str | None:
        """Wait until the run ends (at most ``timeout_s``); its outcome (``done``, ``stopped``...), ``None`` if it is
        still running at the deadline."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.live():
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)
        return self.outcome()

    def outcome(self) -> str | None:
        """How the run ended, once it has (``control.json`` says), else ``None``."""
        try:
            return read_control(self.run_dir).get("outcome")
        except (FileNotFoundError, ValueError):
            return None

    def dashboard(self, poll_s: float = 0.5):
        """A live dashboard of the run (curves, phase times, latest metrics, the controls), fed from its metrics file
        as its driver writes it."""
        from rlnb import VIEWS

        return VIEWS["attached_dashboard"](self, poll_s)

    def __repr__(self) -> str:
        try:
            s = self.status()
            state = f"step {s['step']}/{s['total']}{', paused' if s['paused'] else ''}"
        except RunNotLiveError:
            state = f"ended ({self.outcome() or 'unknown'})"
        return f"AttachedRun({str(self.run_dir)!r}, {self.recipe.name}, {state})"


def attach(run: str | os.PathLike, root: str | os.PathLike = "runs") -> AttachedRun:
    """The live run in the directory ``run`` (or named ``run`` under ``root``, as ``rlnb ps`` lists them), driven by
    another process (``rlnb run --detach``, ``loop.detach()``, or any ``rlnb run``): steer it and watch it as its
    own notebook would (:class:`AttachedRun`).

    Raises:
        RunNotLiveError: no driver serves the run (it ended, or it is not reachable from here).
        ConfigError: (``run_dir``) neither a run directory nor the name of one under ``root``.
    """
    path = Path(run)
    if not (path / "recipe.yaml").is_file() and (Path(root) / path.name / "recipe.yaml").is_file():
        path = Path(root) / path.name
    return AttachedRun(path)


def live_runs(root: str | os.PathLike = "runs") -> list[dict]:
    """The runs under ``root`` (its run directories, one level down) whose driver answers: ``run_dir``, ``recipe``,
    ``pid``, ``step``, ``total``, ``paused``."""
    out = []
    root = Path(root)
    for control in sorted(root.glob(f"*/{CONTROL_FILE}")) if root.is_dir() else []:
        try:
            run = AttachedRun(control.parent)
            s = run.status()
        except (RlnbError, ConfigError, OSError, ValueError):
            continue
        out.append({"run_dir": str(control.parent), "recipe": run.recipe.name, "pid": run._control()["pid"],
                    "step": s["step"], "total": s["total"], "paused": s["paused"]})  # fmt: skip
    return out
