"""Compiled training steps: ``torch.compile`` of an actor's objective (forward and loss; AOTAutograd
compiles its backward with it), compiled once up front and timed, with an eager fallback.

``actor.compile`` is ``auto`` by default: on where a compiled step measured faster than eager, compile
time included, over the bundled recipes (``bench/compile.py``; :data:`AUTO` holds the choice per device).
Compiled artefacts go to a per-user cache shared by the workers (:func:`cache_dir`), so a second run of
the same recipe loads them instead of compiling again.

Example (in-process):
    >>> import torch
    >>> compiler = StepCompiler.for_device(True, torch.device("cpu"), "actor")
    >>> compiler.ready, compiler.compile_s
    (False, None)
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger("rlnb")

AUTO = {"cpu": False, "cuda": False}
"""``actor.compile: auto`` per device type: off on both, as measured. CPU: ``bench/compile.py`` (see
``docs/benchmarks.md``): compile time exceeds what the faster steps save over the bundled recipes' runs.
CUDA (``make gpu-check``, ``docs/gpu.md``): steps are faster compiled, but a PPO CartPole run solves sooner
eager, the compile taking most of the compiled run. Set ``actor.compile: true`` for models big enough that a
step costs more than kernel launches. For the built-in MLP policy the eager step is the fused one
(``rlnb.components.fused``, ``actor.fused_step``), faster than the compiled one on CPU; compiling turns it off."""


def cache_dir() -> str:
    """Where compiled kernels are cached: ``$TORCHINDUCTOR_CACHE_DIR`` if set, else
    ``$XDG_CACHE_HOME/rlnb/inductor`` (``~/.cache/rlnb/inductor``), one per user and shared by every
    worker process of the machine."""
    import getpass

    # inductor writes its own default (<temporary directory>/torchinductor_<user>) into the variable when it first
    # needs one, in whichever process that was and with that process's temporary directory: not the user's choice
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.basename(given.rstrip("/")) != f"torchinductor_{getpass.getuser()}":
        return given
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(base / "rlnb" / "inductor")


def backend() -> str:
    """The ``torch.compile`` backend: ``inductor``, or ``$RLNB_COMPILE_BACKEND`` on the workers (e.g.
    ``aot_eager`` where no C++ compiler is installed)."""
    return os.environ.get("RLNB_COMPILE_BACKEND") or "inductor"


def resolve_compile(setting, device: torch.device) -> bool:
    """``actor.compile`` (``auto``, ``true`` or ``false``) for ``device``."""
    return AUTO.get(device.type, False) if setting == "auto" else bool(setting)


def _reason(error: BaseException) -> str:
    """One line: the error and, when it wraps another (a backend failure does), the innermost cause."""

    def line(e: BaseException) -> str:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")

    root = error
    while root.__cause__ is not None or getattr(root, "inner_exception", None) is not None:
        root = root.__cause__ or root.inner_exception
    return (line(error) if root is error else f"{line(error)} ... {line(root)}")[:400]


class StepCompiler:
    """Compiles an objective ``fn(minibatch) -> (loss, metrics)`` on its first minibatch.

    :meth:`warm_up` compiles it and runs it once forward and backward (the gradients are then cleared,
    so training is unchanged), which times compilation apart from training: ``compile_s``. If
    compiling fails, the objective runs eager and ``fallback`` says why (one warning).
    """

    def __init__(self, where: str):
        self.where = where
        # the layers warm_up compiles one by one (compile_layers), and gives their eager forward back on a failure;
        # empty: the whole objective is compiled
        self.layers: list[torch.nn.Module] = []
        self.fn = None
        self.ready = False
        self.compile_s: float | None = None
        self.fallback: str | None = None
        self._reported = False

    @classmethod
    def for_device(cls, setting, device: torch.device, where: str) -> StepCompiler | None:
        """A compiler if ``setting`` turns compilation on for ``device``, else ``None`` (eager)."""
        return cls(where) if resolve_compile(setting, device) else None

    def compile_layers(self, layers: list[torch.nn.Module]) -> None:
        """Have :meth:`warm_up` compile each of ``layers``' forward instead of the whole objective (a sharded model:
        FSDP2's hooks around each layer stay outside the compiled code, which would break its graph at every one).
        Identical layers share their compiled code; a new sequence length compiles once more, then with dynamic
        shapes (``torch.compile``'s default). Until the warm-up (a warm start before the first update) they run
        eager."""
        self.layers = list(layers)

    def warm_up(self, objective, minibatch: dict, module: torch.nn.Module) -> None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir()  # read when inductor first writes or loads
        t0 = time.perf_counter()
        backward_done = False
        try:
            for layer in self.layers:  # (their forward compiles here; the objective runs eager around them)
                layer.forward = torch.compile(layer.forward, backend=backend())
            fn = objective if self.layers else torch.compile(objective, dynamic=False, backend=backend())
            loss, _ = fn(minibatch)
            loss.backward()
            backward_done = True
            self.fn = fn
        except Exception as e:  # a compiler or backend failure: train eager rather than not at all
            self.fallback = _reason(e)
            # info here: the driver's loop warns once for all ranks (a warning would be forwarded too)
            log.info("%s: torch.compile failed (%s); training eager", self.where, self.fallback)
            for layer in self.layers:  # (the instance attribute set above gone: the class's forward again)
                layer.__dict__.pop("forward", None)
            self.fn = objective
            if not backward_done:  # data-parallel ranks all run one warm-up backward (its all-reduce)
                objective(minibatch)[0].backward()
        finally:
            for p in module.parameters():
                p.grad = None
            self.compile_s = time.perf_counter() - t0
            self.ready = True

    def report(self) -> dict:
        """``compile_s`` (and ``compile_failed``) once, after warming up: for the train step's summary."""
        if not self.ready or self._reported:
            return {}
        self._reported = True
        return {"compile_s": self.compile_s, **({"compile_failed": 1.0} if self.fallback else {})}

    def stats(self) -> dict:
        """Whether the step runs compiled, how long compiling took, why it fell back, and dynamo's
        counters in this process (graphs compiled, frames it compiled)."""
        from torch._dynamo.utils import counters

        return {
            "compiled": self.ready and self.fallback is None,
            "what": f"{len(self.layers)} layers" if self.layers else "the objective",
            "compile_s": self.compile_s,
            "fallback": self.fallback,
            "graphs": int(counters["stats"].get("unique_graphs", 0)),
            "frames_ok": int(counters["frames"].get("ok", 0)),
            "cache_dir": cache_dir(),
            "backend": backend(),
        }
