"""Metric logging: ``metrics.jsonl`` always; TensorBoard and Weights & Biases when available.

Observers (the notebook dashboard, progress bars) subscribe with ``add_listener``; the logger
never imports widgets.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from rlnb.files import append_private, open_regular, read_text_regular, write_private

GLOSSARY: dict[str, str] = {
    # bookkeeping
    "step": "Training steps done (= the policy version the actor holds).",
    "global_step": "Embodied PPO and SAC: env steps collected so far (all env ranks).",
    "samples_total": "GRPO: completions trained on so far (data.prompts_per_step x algorithm.group_size a step).",
    "wall_time": "Seconds since the run started, when this record was logged.",
    # env
    "env/success_rate": "Share of the last 20 finished training episodes that succeeded, where the env says so at an episode's end (info['is_success'], as SB3's rollout/success_rate; ManiSkill's success); not logged for envs that do not.",
    "eval/success_rate": "Share of the evaluation's episodes that succeeded, where the env says so (info['is_success']).",
    "env/episode_return_mean": "Mean return of the last 20 finished episodes (undiscounted, before reward normalisation).",
    "env/episode_len_mean": "Mean length of the last 20 finished episodes, in env steps.",
    # rollout
    "rollout/steps_per_s": "Env steps per second of the rollout phase (all env ranks).",
    "rollout/episodes_finished": "Episodes that ended during this step's rollout.",
    "rollout/tokens_per_s": "Tokens generated per second (asynchronous mode: over the generation time itself).",
    "rollout/response_len_mean": "Mean completion length, in tokens.",
    "rollout/reward_mean": "Mean reward of this step's completions.",
    "rollout/turns_mean": "LM, rollout.max_turns >= 2: the model's turns per transcript this step, on average (a transcript ends when the interaction returns None, at max_turns, or when its next turn would not fit in the model's positions).",
    "rollout/truncated_frac": "LM: share of this step's completions that reached rollout.max_new_tokens without ending (no EOS); algorithm.mask_truncated_completions leaves them out of the loss (TRL's completions/clipped_ratio).",
    "sync/bytes": "actor.lora.sync=adapters, rollout ranks apart from the actor: the bytes this step's weight sync put for all of them (the merged weights and the adapted layers' base on the first sync and after a full warm start, the adapters alone after).",
    "sync/adapters_only": "actor.lora.sync=adapters: 1 where this step's weight sync sent the adapters alone, 0 where it sent merged weights.",
    "rollout/is_ratio_mean": "algorithm.mismatch_correction: the mean importance ratio pi_trainer / pi_engine of the trained tokens (of their completions at sequence level) before truncation: 1 where the engine and the trainer agree.",
    "rollout/is_clipped_frac": "algorithm.mismatch_correction=tis: the share of trained tokens whose weight was truncated at algorithm.mismatch_cap.",
    "rollout/is_masked_frac": "algorithm.mismatch_correction=mis: the share of trained tokens whose weight was 0 (ratio outside [mismatch_floor, mismatch_cap]).",
    "rollout/is_kl": "algorithm.mismatch_correction: KL(engine || trainer) a token, the k3 estimate over the sampled tokens: 0 where they agree.",
    "rollout/sampling_rounds": "LM, algorithm.dynamic_sampling: generation rounds this step took to fill its batch with groups that have a learning signal (at most algorithm.max_sampling_rounds).",
    "rollout/signal_frac": "LM, algorithm.dynamic_sampling: share of every group sampled this step whose completions did not all score alike.",
    "rollout/informative_frac": "LM, algorithm.dynamic_sampling: share of the trained batch's groups with a learning signal (1.0 unless the rounds ran out and groups without one topped it up).",
    "rollout/accuracy": "Share of this step's completions with reward >= 1 (exact answers; with several rewards, the first).",
    "rollout/staleness_mean": "Asynchronous mode: mean policy versions between a token's generation and the step training on it.",
    "rollout/staleness_max": "Asynchronous mode: the largest such staleness in the batch (<= algorithm.max_staleness).",
    "cluster/ranks": "cluster.elastic: the env and rollout ranks live at the end of the step (workers lost or closed leave, ones that join are given ranks).",
    "cluster/reissued": "cluster.elastic: shares of a step's batch collected again because their rank's worker was lost mid-collection, over the run.",
    "cluster/joined": "cluster.elastic: env and rollout ranks given to workers that joined the cluster, over the run.",
    "rollout/interrupted_frac": "Asynchronous LM mode: share of sequences whose generation spanned a weight update.",
    "rollout/weight_swaps": "Asynchronous LM mode: weight updates rollout ranks loaded mid-generation.",
    "rollout/overlap_frac": "Share of rollout time hidden behind training (0: synchronous).",
    "rollout/pipeline_overlap_frac": "Embodied PPO with the env apart from the rollout (channels, env.pipeline_stages): share of the shorter of env stepping and inference hidden behind the other, (time/env_s + time/inference_s - time/rollout_s) / min of the two, in [0, 1] (0: one after the other).",
    # reward
    "reward/mean": "Mean reward the reward component gave this step's completions.",
    "reward/accuracy": "Share of this step's completions the reward scored >= 1 (with several rewards, the first).",
    "reward/<name>/mean": "With several rewards (reward.name a list): the mean score the reward <name> gave this step's completions, before its weight.",
    # advantages
    "advantages/advantage_mean": "Mean advantage before minibatch normalisation.",
    "advantages/advantage_std": "Standard deviation of the advantages.",
    "advantages/advantage_abs_mean": "Mean absolute advantage (LM: over response tokens; 0 when every group is all-equal).",
    "advantages/zero_advantage_frac": "LM: share of sequences whose advantages are all 0 (a group whose completions all scored alike): no learning signal (TRL's frac_reward_zero_std).",
    "advantages/kl_mean": "REINFORCE++ with a KL penalty: mean per-token KL to the reference policy in the returns.",
    "advantages/return_mean": "Mean return target (value targets for PPO; per-token returns for REINFORCE++).",
    "advantages/logprob_drift": "Mean |log-prob now - behaviour log-prob| over response tokens: how far the actor moved from the policy that sampled. Over the sequences the update computes; absent when it computes none (every group scored alike).",
    # memory
    "memory/critic_bytes": "LM actor with a value model (algorithm.advantage=token_gae): bytes of its parameters, gradients and AdamW state on one actor rank (float32; its shards under actor.strategy=fsdp2).",
    "memory/ref_bytes": "LM actor: bytes of the KL reference model one actor rank holds (algorithm.kl_coef > 0; its shards under actor.strategy=fsdp2; with LoRA the reference is the model with its adapters off, and none is logged).",
    "memory/actor_state_bytes": "LM actor: bytes of parameters, gradients and optimizer state one actor rank holds (its local shards); actor.dtype=bfloat16 keeps them float32 (master weights) and saves activations instead.",
    "memory/cuda_peak_bytes": "LM actor on a GPU: the actor process's peak GPU allocation over the step (a collocated rollout's too).",
    # train
    "train/loss": "Total loss of the last update (policy + value + entropy terms, KL when on).",
    "train/policy_loss": "Clipped surrogate loss (pg_loss), averaged over minibatches.",
    "train/value_loss": "Value-function loss (v_loss), averaged over minibatches.",
    "train/entropy": "Mean policy entropy over the batch; falling fast means the policy commits early.",
    "train/approx_kl": "Approximate KL(old || new), estimator (ratio - 1) - log ratio; large values mean big policy steps (LM: over the sequences the update computed, see train/rows_computed_frac).",
    "train/clip_frac": "Share of samples whose probability ratio left [1 - clip_coef, 1 + clip_coef] (LM: over the sequences the update computed).",
    "train/ratio_mean": "Mean probability ratio new / old over the update (drifts from 1 as the policy moves).",
    "train/explained_variance": "1 - Var(returns - values) / Var(returns): 1 is a perfect value function, <= 0 useless.",
    "train/grad_norm": "LM actor: gradient norm before clipping to algorithm.max_grad_norm.",
    "train/rows_computed_frac": "LM actor: share of the batch's sequences that went through the update's forward and backward (actor.skip_zero_advantage leaves out those adding exactly 0).",
    "train/lr": "Learning rate used in this update (after annealing).",
    "train/epochs": "Update epochs actually run (fewer when target_kl stopped early).",
    "train/critic_warmup": "1 while algorithm.critic_warmup_steps fits the value function alone (no policy update), then 0.",
    "train/kl": "Mean KL to the reference policy (LM, algorithm.kl_coef > 0).",
    "train/behave_weight_mean": "Decoupled PPO: mean behaviour importance weight of kept tokens.",
    "train/behave_masked_frac": "Decoupled PPO: share of tokens dropped by behave_weight_cap.",
    # steering
    "steer/lr": "Learning rate set between steps (set_hyperparameters or the dashboard), logged on the first step using it.",
    "steer/ent_coef": "Entropy coefficient set between steps, logged on the first step using it.",
    "steer/clip_coef": "Clip coefficient set between steps, logged on the first step using it.",
    # time
    "time/sync_s": "Seconds in sync_weights() (actor -> rollout weights). On one collocated slot it also holds the step's one round trip or, for a step the worker ran ahead of the driver (runner.run_ahead), the worker's wait before it.",
    "time/rollout_s": "Seconds in rollout() (env stepping, inference, rewards, the batch hand-off).",
    "time/advantages_s": "Seconds in advantages().",
    "time/train_s": "Seconds in train(), compile time excluded.",
    "time/compile_s": "Seconds compiling the train step (torch.compile), on the step it happened.",
    "time/env_s": "Embodied PPO: seconds inside the vector envs' own step() during the rollout (the slowest rank; with the env apart, the slowest env rank).",
    "time/inference_s": "Embodied PPO: seconds of policy inference (forward and sampling) during the rollout (the slowest rank).",
    "time/advantages_compute_s": "Embodied PPO: seconds of the advantage estimator's own computation (mean over actor ranks).",
    "time/train_compute_s": "Embodied PPO: seconds of the minibatch updates themselves: forward, loss, backward, optimizer (mean over actor ranks).",
    "time/overhead_frac": "Collocated synchronous PPO: the share of the step outside the work itself (env stepping, inference, advantage and update compute): calls, hand-offs, bookkeeping.",
    "time/step_s": "Seconds of the whole step (the phases above).",
    "time/eval_s": "Seconds in evaluate().",
    "time/sft_s": "Seconds of the supervised warm start.",
    "time/warm_start_s": "Embodied: seconds of the behaviour-cloning warm start (recording the expert's episodes and training on them).",
    # eval and SFT
    "train/q_loss": "SAC: the twin Q-networks' soft Bellman error (the sum of both MSEs against the target), mean over the step's updates.",
    "train/q1_mean": "SAC: mean Q1(s, a) over the sampled batches; rising without bound means the critic overestimates.",
    "train/q2_mean": "SAC: mean Q2(s, a) over the sampled batches.",
    "train/actor_loss": "SAC: the policy's loss, E[alpha log pi(a|s) - min Q(s, a)], mean over the step's updates.",
    "train/alpha": "SAC: the entropy coefficient after the step (tuned towards sac.target_entropy, or sac.alpha fixed).",
    "train/alpha_loss": "SAC: the entropy coefficient's loss, -log alpha (log pi + target entropy), mean over the step's updates.",
    "train/updates": "SAC: gradient updates this step (sac.utd_ratio per transition added, none during sac.learning_starts).",
    "train/updates_total": "SAC: gradient updates since the run began.",
    "buffer/size": "SAC: transitions the replay buffer holds (at most buffer.capacity).",
    "eval/return_mean": "Mean return of deterministic evaluation episodes on fresh envs.",
    "eval/return_std": "Standard deviation of those returns.",
    "eval/len_mean": "Mean length of the evaluation episodes.",
    "eval/accuracy": "Greedy accuracy on held-out problems.",
    "eval/video": "An evaluation episode's video (loop.record_episode()): its MP4 under videos/ in the run directory; in TensorBoard an animated GIF (Images), in W&B a video; in metrics.jsonl its path (relative to the run directory).",
    "eval/video_return": "Return of the episode in eval/video.",
    "eval/video_len": "Length (steps) of the episode in eval/video.",
    "eval/pass_at/<name>": "With data.eval_samples n > 1: pass@<name>, the unbiased estimate (Chen et al. 2021) that <name> of a held-out problem's n sampled completions hold a correct one (the first reward >= 1), averaged over problems.",
    "eval/avg_at/<name>": "With data.eval_samples = <name> > 1: the mean accuracy of a held-out problem's <name> sampled completions (avg@<name>), averaged over problems.",
    "eval/reward_mean": "Mean reward of the held-out answers (greedy, or every sample).",
    "eval/size": "Held-out problems evaluated.",
    "sft/loss_first": "Warm-start loss at its first step.",
    "sft/loss_last": "Warm-start loss at its last step.",
    "sft/steps": "Warm-start steps run.",
    "warm_start/nll_first": "Embodied warm start: mean negative log-likelihood of the expert's actions over its first epoch (a VLA: summed over an action's tokens).",
    "warm_start/nll": "Embodied warm start: the same over its last epoch.",
    "warm_start/expert_match": "Embodied warm start, discrete actions: share of the demonstrations' steps where the policy's most likely action is the expert's.",
    "warm_start/expert_action_error": "Embodied warm start, continuous actions: mean absolute difference between the policy's most likely action and the expert's, in the action space's units.",
    "warm_start/epochs": "Embodied warm start: passes over the demonstrations.",
    "warm_start/samples": "Embodied warm start: demonstration steps trained on.",
    "warm_start/expert_success_rate": "Embodied warm start: share of the expert's recorded episodes that succeeded.",
}
"""What every metric the loops log means (``docs/reference/metrics.md`` is generated from it, and the
dashboard shows it on hover)."""


# the work, timed where it runs, inside each phase of an embodied step; the rest of a phase is the loop's own
# (``time/overhead_frac`` is the step minus all of it)
WORK_IN_PHASE: dict[str, tuple[str, ...]] = {
    "sync": (),
    "rollout": ("time/env_s", "time/inference_s"),
    "advantages": ("time/advantages_compute_s",),
    "train": ("time/train_compute_s",),
}


def explain(key: str) -> str | None:
    """What the metric ``key`` means, from :data:`GLOSSARY` (where ``<name>`` stands for any one part of a
    key, e.g. ``reward/<name>/mean`` explains ``reward/format/mean``), or None.

    Example:
        >>> explain("reward/format/mean").startswith("With several rewards")
        True
    """
    if key in GLOSSARY:
        return GLOSSARY[key]
    parts = key.split("/")
    for pattern, text in _PATTERNS:
        if len(pattern) == len(parts) and all(p in ("<name>", k) for p, k in zip(pattern, parts)):
            return text.replace("<name>", parts[pattern.index("<name>")])
    return None


_PATTERNS = [(k.split("/"), v) for k, v in GLOSSARY.items() if "<name>" in k]


def format_value(value) -> str:
    """A metric's value for people: from 1,000 up with thousands separators and no decimals (``31,740``, never
    ``3.174e+04``), four significant digits below.

    Example:
        >>> [format_value(v) for v in (31740.0, 1234567, 0.98765, 12.5, 0.0003, 0, float("nan"), True)]
        ['31,740', '1,234,567', '0.9877', '12.5', '0.0003', '0', 'nan', 'True']
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if not math.isfinite(value):
        return str(float(value))
    if abs(value) >= 1000:  # (a count, or a value whose decimals say nothing at this size)
        return f"{value:,.0f}"
    return f"{value:.4g}"


def undocumented(keys) -> list[str]:
    """The metric names in ``keys`` that :data:`GLOSSARY` does not explain."""
    return sorted(k for k in keys if explain(k) is None)


VIDEO_MAX_FRAMES = 300
"""The most frames of an episode's video TensorBoard gets (an animated GIF holds every frame uncompressed)."""


X_COUNTERS = {"global_step": "env steps", "samples_total": "completions"}
"""Logged counters that curves go along, where a loop logs one, and the axis's label: the dashboard's x, and the
step TensorBoard and W&B get (the training step where a loop logs none)."""

HPARAM_METRICS = ("env/episode_return_mean", "env/success_rate", "eval/return_mean", "eval/success_rate",
                  "eval/accuracy", "reward/mean")  # fmt: skip
"""The metrics TensorBoard's HParams tab shows beside the recipe's settings."""


def flat_settings(config: dict, prefix: str = "") -> dict:
    """A recipe as ``{"section.key": value}`` of numbers, strings and booleans (lists, mappings and ``None`` as
    their JSON), as TensorBoard's hyperparameters take them.

    Example:
        >>> flat_settings({"actor": {"lr": 0.001, "lora": {"rank": 0}}, "env": {"kwargs": {}}, "seed": None})
        {'actor.lr': 0.001, 'actor.lora.rank': 0, 'env.kwargs': '{}', 'seed': 'null'}
    """
    out = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(flat_settings(v, f"{prefix}{k}."))
        elif isinstance(v, (bool, int, float, str)):
            out[f"{prefix}{k}"] = v
        else:
            out[f"{prefix}{k}"] = json.dumps(v, default=str)
    return out


class MetricLogger:
    """Writes one JSON object per step to ``<run_dir>/metrics.jsonl`` and fans out to listeners.

    TensorBoard and W&B get each record at the dashboard's x (:data:`X_COUNTERS`: env steps, completions), and
    the recipe (``config``) as the run's hyperparameters.

    ``read_only``: records go to the listeners and ``history`` only; nothing in ``run_dir`` is written or
    truncated (an evaluation of a run's checkpoint, which may be live).

    Example:
        >>> log = MetricLogger("/tmp/run", tensorboard=False)   # doctest: +SKIP
        >>> log.log(1, {"env/episode_return_mean": 20.0})        # doctest: +SKIP
    """

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        config: dict | None = None,
        read_only: bool = False,
    ):
        self.run_dir = Path(run_dir)
        self.read_only = read_only
        if read_only:
            tensorboard, wandb_project = False, None
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.run_dir / "metrics.jsonl"
        self.history: list[dict] = []
        self._file = None  # metrics.jsonl, open for appending from the first record until close()
        self._file_lock = threading.Lock()
        self._listeners: list[Callable[[dict], None]] = []
        self._row_listeners: list[Callable[[str, int, list], None]] = []
        self._tb = None
        self._wandb = None
        self._x_at: dict[int, int] = {}  # training step -> the X_COUNTERS value logged at it
        if tensorboard:
            fresh = not any((self.run_dir / "tensorboard").glob("events.out.tfevents.*"))
            self._tb = _tensorboard_writer(self.run_dir)
            if self._tb is not None and fresh and config:
                self._log_hparams(config)
        if wandb_project:
            import wandb

            # one wandb run per run directory: a resumed run continues it instead of opening another
            id_file = self.run_dir / "wandb_run_id"
            run_id = read_text_regular(id_file, 256).strip() if id_file.exists() else secrets.token_hex(4)
            write_private(id_file, run_id)
            self._wandb = wandb.init(
                project=wandb_project, dir=str(self.run_dir), config=config or {}, id=run_id, resume="allow"
            )

    def add_listener(self, fn: Callable[[dict], None]) -> None:
        """Call ``fn(record)`` after each logged step (dashboards, progress bars)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[dict], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def add_row_listener(self, fn: Callable[[str, int, list], None]) -> None:
        """Call ``fn(table, step, rows)`` after each :meth:`log_rows` (the dashboard's table of completions)."""
        self._row_listeners.append(fn)

    def remove_row_listener(self, fn: Callable[[str, int, list], None]) -> None:
        if fn in self._row_listeners:
            self._row_listeners.remove(fn)

    def _log_hparams(self, config: dict) -> None:
        from torch.utils.tensorboard.summary import hparams

        # (into the run's own event file, not the separate one SummaryWriter.add_hparams makes)
        for summary in hparams(flat_settings(config), dict.fromkeys(HPARAM_METRICS, 0.0)):
            self._tb._get_file_writer().add_summary(summary)

    def x_at(self, step: int, record: dict | None = None) -> int:
        """The dashboard's x at training step ``step`` (:data:`X_COUNTERS`, read from ``record`` where it has one):
        what TensorBoard and W&B log at; the step itself where the loop logs no counter."""
        for counter in X_COUNTERS:
            value = (record or {}).get(counter)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._x_at[step] = int(value)
                return int(value)
        if step in self._x_at:
            return self._x_at[step]
        if not self._x_at:
            return step
        earlier = [s for s in self._x_at if s <= step]  # (a record of a step before its counter: the last x)
        return self._x_at[max(earlier)] if earlier else 0

    def log(self, step: int, metrics: dict) -> dict:
        record = {"step": step, "wall_time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self._append(json.dumps(record) + "\n")
        self.history.append(record)
        if self._tb is not None or self._wandb is not None:
            x = self.x_at(step, record)
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "wall_time") and math.isfinite(v):
                    self._tb.add_scalar(k, v, x)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=x)
        for fn in list(self._listeners):
            fn(record)
        return record

    def log_video(self, step: int, tag: str, path: str | Path, fps: int = 20) -> None:
        """An episode's video (an MP4 file :func:`rlnb.video.write_mp4` wrote) at ``step``: to TensorBoard as an
        animated GIF in an image summary (what TensorBoard's own ``add_video`` writes, without moviepy; at most
        :data:`VIDEO_MAX_FRAMES` frames, evenly taken), to W&B as a ``wandb.Video``. The file stays where it is."""
        if self.read_only or (self._tb is None and self._wandb is None):
            return
        if self._tb is not None:
            import io

            import imageio.v2 as imageio
            import numpy as np
            from tensorboard.compat.proto.summary_pb2 import Summary

            frames = list(imageio.get_reader(path).iter_data())  # (its length is unknown up front)
            keep = np.linspace(0, len(frames) - 1, min(len(frames), VIDEO_MAX_FRAMES)).round().astype(int)
            gif = io.BytesIO()
            imageio.mimwrite(gif, [frames[i] for i in keep], format="GIF", duration=1000 / fps, loop=0)
            h, w = frames[0].shape[:2]
            image = Summary.Image(height=h, width=w, colorspace=3, encoded_image_string=gif.getvalue())
            self._tb._get_file_writer().add_summary(
                Summary(value=[Summary.Value(tag=tag, image=image)]), self.x_at(step)
            )
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            self._wandb.log({tag: wandb.Video(str(path), fps=fps, format="mp4")}, step=self.x_at(step))

    def _append(self, line: str) -> None:
        """Append ``line`` to ``metrics.jsonl``, kept open between records (opening it for each record cost
        a measurable share of a fast step); line-buffered, so each record is in the file once written (a killed run leaves at
        most a torn last line, which :func:`read_metrics` drops)."""
        if self.read_only:
            return
        with self._file_lock:  # (a background run logs from its own thread)
            if self._file is None:
                # (0600: a run's data is its user's)
                self._file = append_private(self.path, buffering=1)  # (closed by close() or the finalizer)
                # (a logger never closed still closes it)
                self._closer = weakref.finalize(self, self._file.close)
            self._file.write(line)

    def log_rows(self, table: str, step: int, rows: list[dict]) -> None:
        """Append ``rows`` (each with ``"step": step``) to ``<run_dir>/<table>.jsonl``, one JSON object a line
        (e.g. the ``completions`` the LM loop samples; :func:`read_table` reads them back). On resume,
        :meth:`truncate_after` drops the rows of later steps, as it does records."""
        if table not in TABLES:
            raise ValueError(f"log_rows: expected a table in {TABLES}, got {table!r}")
        for fn in list(self._row_listeners):
            fn(table, step, rows)
        if self.read_only:
            return
        lines = "".join(
            json.dumps({"step": step, **{k: _plain(v) for k, v in r.items()}}) + "\n" for r in rows
        )
        path = self.run_dir / f"{table}.jsonl"
        with append_private(path) as f:
            f.write(lines)

    def _close_file(self) -> None:
        with self._file_lock:
            if self._file is not None:
                self._closer()  # (closes the file; the finalizer is then done)
                self._file = None

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps after ``step`` (they will be recomputed), in ``metrics.jsonl``
        (rewritten atomically; a torn last line of a killed run is dropped) and in TensorBoard (its
        events from ``step + 1`` on are purged, so curves do not overlap)."""
        if self.read_only:
            return
        self._close_file()  # (the file is replaced below: the next record opens the new one)
        for table in TABLES:
            _keep_through(self.run_dir / f"{table}.jsonl", step)
        if self.path.exists():
            self.history = _keep_through(self.path, step)
        self._x_at = {}
        for record in self.history:
            self.x_at(int(record.get("step", 0)), record)
        if self._tb is not None:  # (purged from the x after the step's on: TensorBoard's steps are the x)
            self._tb.close()
            self._tb = _tensorboard_writer(self.run_dir, purge_step=self.x_at(step) + 1)

    def close(self) -> None:
        self._close_file()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else v
    return v


def _tensorboard_writer(run_dir: Path, purge_step: int | None = None):
    """TensorBoard's writer for the run; ``None``, said once, where ``tensorboard`` cannot be imported (a
    dependency of rlnb, so only where it was removed or broken)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        global _TENSORBOARD_MISSING_SAID
        if not _TENSORBOARD_MISSING_SAID:
            _TENSORBOARD_MISSING_SAID = True
            logging.getLogger("rlnb").warning(
                "runner.tensorboard is on but TensorBoard cannot be imported (%s): no event files are written. "
                "`pip install tensorboard`, or set runner.tensorboard=false to say so",
                e,
            )
        return None
    if purge_step is not None:
        _after_existing_event_files(run_dir / "tensorboard")
    return SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)


def _after_existing_event_files(directory: Path) -> None:
    """Wait, if need be, until a new event file's name sorts after those in ``directory``. TensorBoard reads a
    run's files in name order, and a resumed run's purge only drops the steps of files read before it; the names
    start with the second they were made in, then host, pid and a counter, which sort as text ("...10" before
    "...9"). A file made in a later second sorts after them whatever follows: at most a second's wait, on a
    resume within the second of the last file."""
    latest = 0
    for f in directory.glob("events.out.tfevents.*"):
        stamp = f.name.split(".")[3]
        if stamp.isdigit():
            latest = max(latest, int(stamp))
    if latest > time.time() + 1:  # stamped ahead of this clock (another machine's): no short wait would do
        return
    while int(time.time()) <= latest:
        time.sleep(0.05)


_TENSORBOARD_MISSING_SAID = False


TABLES = ("completions",)
"""The run's row logs beside ``metrics.jsonl`` (:meth:`MetricLogger.log_rows`)."""


def _keep_through(path: Path, step: int) -> list[dict]:
    """Rewrite the JSON-lines file ``path`` atomically with its rows of steps up to ``step``; returns them."""
    if not path.exists():
        return []
    kept = [r for r in _read_jsonl(path) if _step_of(r) <= step]
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(3)}")
    try:
        write_private(tmp, "".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return kept


def _step_of(record: dict) -> int:
    """A record's step (0 where it has none); a row that is not a record, or whose step is not a whole number,
    counts as past every step (dropped by a truncation)."""
    step = record.get("step", 0) if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else 2**63


def read_table(run_dir: str | Path, table: str = "completions") -> list[dict]:
    """The rows of a run's ``<table>.jsonl`` (:meth:`MetricLogger.log_rows`), e.g. the completions an LM run
    logged (``runner.completions_interval``)."""
    return _read_jsonl(Path(run_dir) / f"{table}.jsonl")


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All records of a run's ``metrics.jsonl``; a line that does not parse (the torn last line of a
    killed run) is skipped."""
    return _read_jsonl(Path(run_dir) / "metrics.jsonl")


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(open_regular(path), encoding="utf-8", errors="replace") as f:  # (never through a link)
        return _parse_lines(f.read())


def _parse_lines(text: str) -> list[dict]:
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsTail:
    """Follows a run's ``metrics.jsonl`` as its driver writes it: each :meth:`new` gives the records appended since
    the last one, whole lines only (a line still being written waits for the next call), reading only the new
    bytes. A file replaced or cut short (a resumed run rewrites it) is read again from its start."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.offset, self.inode = 0, None

    def new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(open_regular(self.path), "rb") as f:  # (never through a link)
            st = os.fstat(f.fileno())
            if st.st_ino != self.inode or st.st_size < self.offset:
                self.offset, self.inode = 0, st.st_ino
            f.seek(self.offset)
            data = f.read()
        whole = data.rfind(b"\n") + 1
        self.offset += whole
        return _parse_lines(data[:whole].decode("utf-8", errors="replace"))
