"""Each actor rank's memory while a sharded LM actor loads: whole, then sharded (DDP's way in, and FSDP2's before it
read shards), against rank by rank (``actor.strategy: fsdp2``: built on the meta device, sharded, each rank reading
only its shards of the safetensors checkpoint).

Run: ``.venv/bin/python bench/lm_load.py [--size 1024x12]`` (prints a table; not a timed test). Two CPU ranks on an
embedded cluster, a fresh one per way (memory a process gave back is not always returned to the system). For each
rank: its resident memory before launch, and the peak from launch to the end of ``setup_data_parallel()``
(``VmHWM``, reset first), both in MiB, after the libraries a load imports are imported; the model's float32 bytes beside them; the ratio of the two ways' peak
increases. Whole: ``actor.strategy=ddp``, which loads with ``from_pretrained`` on every rank.
"""

from __future__ import annotations

import argparse
import time

from _scaled import import_what_loading_imports, peak_mib, reset_peak, resident_mib, scaled_models

import rlnb
from rlnb.components.lm import LMActor
from rlnb.components.lm.shard_load import checkpoint_files, weight_count


def load(path: str, strategy: str) -> list[tuple[float, float, float]]:
    """``(resident before, peak while loading, seconds)`` of each of two actor ranks loading ``path``."""
    with rlnb.Cluster(slots=2, gpus=False) as cluster:
        cluster.client.run(import_what_loading_imports)
        before = cluster.client.run(resident_mib)
        cluster.client.run(reset_peak)
        t0 = time.perf_counter()
        actor = LMActor.launch(cluster, "0-1", model_path=path, actor={"strategy": strategy}, group_size=4)
        actor.init_process_group()
        actor.setup_data_parallel().result()
        seconds = time.perf_counter() - t0
        peak = cluster.client.run(peak_mib)
        addresses = sorted(before)
        actor.shutdown()
    return [(before[a], peak[a], seconds) for a in addresses]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1024x12", help="HIDDENxLAYERS of the model built")
    args = parser.parse_args()
    for size, path in scaled_models([args.size]):
        model_mib = weight_count(checkpoint_files(path)) * 4 / 2**20
        rows = {s: load(path, s) for s in ("ddp", "fsdp2")}
        print(f"model {size}: {model_mib:.0f} MiB of float32 weights; two CPU ranks")
        print(f"{'way':<28}{'rank':>5}{'before MiB':>12}{'peak MiB':>10}{'increase':>10}{'s':>7}")
        increase = {}
        for strategy, label in (("ddp", "whole (from_pretrained)"), ("fsdp2", "rank by rank (meta, shards)")):
            increase[strategy] = []
            for rank, (before, peak, seconds) in enumerate(rows[strategy]):
                increase[strategy].append(peak - before)
                print(
                    f"{label:<28}{rank:>5}{before:>12.0f}{peak:>10.0f}{peak - before:>10.0f}{seconds:>7.1f}"
                )
        ratio = max(increase["fsdp2"]) / max(increase["ddp"])
        print(f"rank by rank / whole, the larger rank's peak increase: {ratio:.2f}")


if __name__ == "__main__":
    main()
