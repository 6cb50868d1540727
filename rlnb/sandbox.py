"""Running a model's code: a Python subprocess with CPU-time, memory, file-size, open-file and wall-clock limits,
no network, an empty working directory and environment (``reward.sandbox``; the ``python`` tool and the
``code_tests`` reward run through it, on the reward's or the rollout's slots).

The limits are set inside the child before the code runs (a small bootstrap sets ``setrlimit`` and enters a network
namespace of its own, then executes the code read from stdin), so the worker that starts it never forks with
locks held by its threads. A network namespace needs root or unprivileged user namespaces; where neither is there,
:func:`run_python` refuses to run code rather than run it with the network.

Example:
    >>> run_python("print(6 * 7)").stdout
    '42\\n'
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from rlnb.bounds import bounded, bounds_errors
from rlnb.errors import ConfigError

# the child: limits, a network namespace of its own (no interface but a loopback that is down), then the code
_BOOT = r"""
import ctypes, os, resource, sys
cpu, mem, fsize, nofile = (int(x) for x in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
if libc.unshare(CLONE_NEWNET) != 0 and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
    sys.stderr.write("rlnb-sandbox: no network namespace (errno %d)\n" % ctypes.get_errno())
    os._exit(97)
code = sys.stdin.read()
sys.stdin = open(os.devnull)
del ctypes, libc, resource, cpu, mem, fsize, nofile
exec(compile(code, "<model code>", "exec"), {"__name__": "__main__"})
"""
NO_NETNS = 97  # the bootstrap's exit status where no network namespace could be made


@dataclass
class SandboxConfig:
    """Limits on code a model wrote (``reward.sandbox``): the ``python`` tool and the ``code_tests`` reward."""

    cpu_s: int = bounded(2, 1, 3600, "an hour of CPU is a job, not a tool call")
    """CPU seconds the code may use (``RLIMIT_CPU``: SIGXCPU, then SIGKILL)."""
    wall_s: float = bounded(5.0, 0.1, 3600, "an hour of waiting stalls the step")
    """Seconds of wall-clock time before the process group is killed (a ``sleep`` uses no CPU)."""
    memory_mb: int = bounded(512, 64, 65_536, "more than a rank's share of a machine")
    """Address space in MiB (``RLIMIT_AS``; the interpreter itself takes ~30 of them)."""
    file_mb: int = bounded(1, 0, 1024, "a tool call's files are scratch")
    """The largest file the code may write, in MiB (``RLIMIT_FSIZE``), in an empty directory removed after."""
    output_chars: int = bounded(2000, 1, 1_000_000, "more than a context holds")
    """Characters of stdout and of stderr kept (the rest cut, with a note)."""

    def errors(self, prefix: str = "reward.sandbox") -> list[str]:
        return bounds_errors(self, f"{prefix}.")


@dataclass(frozen=True)
class SandboxResult:
    """What the code did: its ``stdout`` and ``stderr`` (cut at ``output_chars``), exit status (negative: the
    signal that ended it) and whether the wall-clock limit ended it."""

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def text(self) -> str:
        """What a tool returns to the model: the output, or the error's last line."""
        if self.timed_out:
            return "error: timed out"
        if self.returncode < 0:  # a signal: SIGKILL at the CPU limit (or the kernel's at the memory one)
            return f"error: ended by signal {-self.returncode} (a limit reached)"
        if self.returncode != 0:
            last = self.stderr.strip().splitlines()[-1:] or [f"exit status {self.returncode}"]
            return f"error: {last[0]}"
        return self.stdout


def run_python(code: str, limits: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` in a sandboxed Python (see the module's doc) and return what it did.

    Raises:
        ConfigError: ``limits`` out of their bounds (naming the key), or no network namespace can be made here.
    """
    limits = limits or SandboxConfig()
    errors = limits.errors()
    if errors:
        raise ConfigError(errors[0], errors[0].split(":")[0])
    mb = 2**20
    args = [str(limits.cpu_s), str(limits.memory_mb * mb), str(limits.file_mb * mb), "64"]
    with tempfile.TemporaryDirectory(prefix="rlnb-sandbox-") as cwd:
        env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOT, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=cwd, env=env, start_new_session=True, text=True, errors="replace",
        )  # fmt: skip
        timed_out = False
        try:
            out, err = proc.communicate(code, timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, 9)  # (its own session: whatever it started goes too)
            out, err = proc.communicate()
    if proc.returncode == NO_NETNS and "rlnb-sandbox: no network namespace" in err:
        raise ConfigError(
            "reward.sandbox: code cannot be cut off from the network here (no network namespace: rlnb runs "
            f"sandboxed code as root or with unprivileged user namespaces; {err.strip()})",
            "reward.sandbox",
        )
    return SandboxResult(
        _cut(out, limits.output_chars), _cut(err, limits.output_chars), proc.returncode, timed_out
    )


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} characters cut]"


__all__ = ["SandboxConfig", "SandboxResult", "run_python"]
