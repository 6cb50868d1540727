"""The ``rlnb`` command line: ``rlnb info``, ``rlnb demo`` (more subcommands join as loops land).

Exit codes: 0 success, 2 bad usage or config, 1 run failure.
"""

from __future__ import annotations

import argparse
import sys

from rlnb.errors import ConfigError, RlnbError


def _info(args) -> int:
    import rlnb

    with rlnb.Cluster(args.address, slots=args.slots, timeout_s=args.timeout_s) as cluster:
        print(cluster.info())
    return 0


def _demo(args) -> int:
    """Runtime demo: a group on every slot, a channel between workers, an all-reduce."""
    import time

    import rlnb
    from rlnb.testing import Collective, Echo

    t0 = time.perf_counter()
    with rlnb.Cluster(args.address, slots=args.slots) as cluster:
        print(f"cluster up in {time.perf_counter() - t0:.1f} s\n{cluster.info()}\n")
        group = rlnb.Group.launch(Echo, cluster, "all")
        for who in group.whoami().result(60):
            print(
                f"  rank {who['rank']}/{who['world_size']} on slot {who['slot']} ({who['device']}) pid {who['pid']}"
            )
        ch = rlnb.Channel.create(cluster, "demo", maxsize=2)
        consumer = group.on(group.world_size - 1).consume(ch, 4, key="t")
        group.on(0).produce(ch, 4, 1 << 20, key="t").result(60)
        print(f"channel: rank 0 -> rank {group.world_size - 1}: first elements {consumer.result(60)[0]}")
        coll = rlnb.Group.launch(Collective, cluster, "all", name="collective")
        print(f"process group: {coll.init_process_group()}; all-reduce -> {coll.all_reduce().result(60)[0]}")
        print(cluster.info())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlnb", description="Reinforcement learning, stepped in notebooks, run on Dask."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (
        ("info", _info, "show cluster slots, devices and versions"),
        ("demo", _demo, "run a short runtime demo on the embedded (or given) cluster"),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument(
            "--address", default=None, help="Dask scheduler address (default: start an embedded cluster)"
        )
        p.add_argument("--slots", type=int, default=None, help="CPU slots for the embedded cluster")
        p.add_argument("--timeout-s", type=float, default=20.0, help="seconds to wait for the scheduler")
        p.set_defaults(fn=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"rlnb: config error: {e}", file=sys.stderr)
        return 2
    except RlnbError as e:
        print(f"rlnb: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
