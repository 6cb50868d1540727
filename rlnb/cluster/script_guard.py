"""The check that an embedded cluster is not started from a script's top level outside
``if __name__ == "__main__":``, whose worker processes would each start a cluster of their own."""

from __future__ import annotations

from rlnb.errors import ClusterError


def _is_main_guard(test) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    import ast

    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, *test.comparators]
    return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
        isinstance(x, ast.Constant) and x.value == "__main__" for x in sides
    )


def runs_at_import(source: str, line: int) -> bool:
    """Whether the module-level statement at ``line`` of a script's ``source`` runs when the script is
    imported, i.e. is not inside an ``if __name__ == "__main__":`` block."""
    import ast

    def within(node) -> bool:
        return node.lineno <= line <= (node.end_lineno or node.lineno)

    def guarded(body: list, inside: bool) -> bool:
        for node in filter(within, body):
            if isinstance(node, ast.If):
                in_body = any(map(within, node.body))
                if _is_main_guard(node.test):  # its body runs only as __main__, its else only when imported
                    inside = in_body
                return guarded(node.body if in_body else node.orelse, inside)
            if isinstance(node, (ast.For, ast.While, ast.With, ast.Try)):
                inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
                return guarded(inner + [s for h in getattr(node, "handlers", []) for s in h.body], inside)
            return inside
        return inside

    return not guarded(ast.parse(source).body, False)


def check_script_guard() -> None:
    """Refuse to start an embedded cluster from a script's top level outside ``if __name__ ==
    "__main__":``. Its worker processes start by spawn or fork server, which import the script again
    (as ``__mp_main__``), so each would start a cluster of its own: Dask then hangs (dask/distributed
    #5726). Checked in the driver before anything starts, and in a worker importing the script."""
    import multiprocessing
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    fix = (
        'put the script\'s body under `if __name__ == "__main__":` (worker processes import the script '
        "again, and each would start a cluster of its own), or connect to a running scheduler with "
        "Cluster(address)"
    )
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise ClusterError(f"an embedded Cluster was started while a worker process imported {path}: {fix}")
    if not path:  # a notebook, a REPL, `python -c`: nothing imports it again
        return
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            if frame.f_code.co_filename != path:
                return  # e.g. an IPython cell running with __main__'s namespace
            try:
                with open(path, encoding="utf-8") as f:
                    source = f.read()
                on_disk = compile(source, path, "exec", dont_inherit=True)
                if (on_disk.co_code, on_disk.co_linetable) != (
                    frame.f_code.co_code,
                    frame.f_code.co_linetable,
                ):
                    return  # the script was edited since it started: its lines are not the running ones
                unguarded = runs_at_import(source, frame.f_lineno)
            except (OSError, SyntaxError, ValueError):
                return  # not a readable script: nothing to check
            if unguarded:
                raise ClusterError(
                    f"{path}:{frame.f_lineno} starts an embedded Cluster at import time: {fix}"
                )
            return
        frame = frame.f_back
