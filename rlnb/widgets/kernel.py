"""The dashboard's controls answered while a cell runs: ``loop.run(live=True)`` in the foreground.

A kernel handles a page's widget messages on its main shell, between cells, so a button clicked while a
foreground run holds the cell waited for the run's end. ipykernel 7's subshells (JEP 91) are shells on threads
of their own; the kernel sends each comm's messages to the subshell the comm names (``_reply_subshell_for``). The
controls' comms name one subshell of this kernel, made once: their clicks are handled there while the main
shell runs the loop (pause, stop, save now and the hyperparameters act on the loop's thread-safe steering).
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("rlnb")

SUBSHELL_START_S = 10.0
"""How long the kernel's shell-channel thread gets to start the controls' subshell."""

_subshell: list[str] = []  # the one subshell of this kernel the controls are routed to, once made
_lock = threading.Lock()


def controls_subshell() -> str | None:
    """The id of a subshell of this kernel for the controls' messages (made on first use), or ``None`` outside
    a kernel that has subshells (IPython without a kernel, ipykernel before 7): there the controls act when the
    kernel is free, as in ``run(background=True)``."""
    try:
        from ipykernel.kernelbase import Kernel
    except ImportError:
        return None
    if not Kernel.initialized():
        return None
    kernel = Kernel.instance()
    thread = getattr(kernel, "shell_channel_thread", None)
    if thread is None or not getattr(kernel, "_supports_kernel_subshells", False):
        return None
    with _lock:
        if _subshell:
            return _subshell[0]
        made: list[str] = []
        done = threading.Event()

        def create() -> None:  # (on the shell-channel thread: the only one that may make a subshell)
            try:
                made.append(thread.manager._create_subshell())
            except Exception:
                log.warning("the dashboard's controls get no subshell of their own", exc_info=True)
            finally:
                done.set()

        thread.io_loop.add_callback(create)
        if not done.wait(SUBSHELL_START_S) or not made:
            return None
        _subshell.append(made[0])
        return made[0]


def route_to_subshell(widgets, subshell_id: str) -> None:
    """Send the page's messages to ``widgets`` (a click, a typed value) to the subshell ``subshell_id``, always
    (ipykernel would otherwise route them back to the main shell after the widget's next message)."""
    for widget in widgets:
        if widget.comm is not None:
            widget.comm._reply_subshell_for = lambda data, default, sid=subshell_id: sid
