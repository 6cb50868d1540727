"""The LM batch layout and the helpers that cut, pad and join batches in it.

A rollout batch (B = prompts x group_size sequences, L = prompt + response tokens; prompts left-padded,
responses right after them, right-padded)::

    input_ids [B, L]  attention_mask [B, L]  response_mask [B, L] (1 on the model's own tokens incl. EOS)
    logprobs [B, L]   (behaviour log-probs on response tokens, 0 elsewhere)
    versions [B, L]   (asynchronous mode: the policy version of each token, -1 on context)
    rewards [B]       group_index [B]   truncated [B]   reward_terms [B, K] (named by reward_names)
    texts, answers, prompts, fields: one entry per sequence
    version           (the oldest policy version that generated it)
"""

from __future__ import annotations

import torch


def pad_left(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)


def pad_right(rows: list[list], pad) -> torch.Tensor:
    """``rows`` right-padded with ``pad`` to the longest: ``[B, W]`` (the dtype of ``pad``'s kind)."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows])


def micro_batches(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


# a batch's [B, W] columns, left-padded to a common width when batches are put together, and their padding
WIDE_COLUMNS = {"attention_mask": 0, "response_mask": 0, "logprobs": 0.0, "versions": -1}


def batch_rows(batch: dict, rows: torch.Tensor) -> dict:
    """The rows ``rows`` (a bool mask or indices over ``B``) of a rollout batch: its tensors and per-sequence
    lists; the rest (``version``, ``reward_names``) as it is."""
    n = len(batch["texts"])
    index = rows.nonzero().squeeze(1).tolist() if rows.dtype == torch.bool else rows.tolist()
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n:
            out[key] = value[index]
        elif isinstance(value, list) and len(value) == n:
            out[key] = [value[i] for i in index]
        else:
            out[key] = value
    return out


def join_batches(parts: list[dict], pad_token_id: int) -> dict:
    """Rollout batches as one: ``[B, W]`` columns left-padded to the widest (as an actor joins its ranks'
    batches), the rest concatenated; ``version`` the oldest."""
    width = max(p["input_ids"].shape[1] for p in parts)

    def left(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    out = {}
    for key, value in parts[0].items():
        if key == "input_ids" or key in WIDE_COLUMNS:
            pad = pad_token_id if key == "input_ids" else WIDE_COLUMNS[key]
            out[key] = torch.cat([left(p[key], pad) for p in parts])
        elif isinstance(value, torch.Tensor) and value.dim():
            out[key] = torch.cat([p[key] for p in parts])
        elif isinstance(value, list):
            out[key] = [x for p in parts for x in p[key]]
        elif key == "version":
            out[key] = min(p[key] for p in parts)
        else:
            out[key] = value
    return out


def same_objects(a: list, b: list) -> bool:
    """Whether two lists hold the same objects in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def decode_group(b: dict, tok, group: int, size: int) -> list[dict]:
    """The ``size`` sequences of group ``group`` in batch ``b``, decoded with ``tok`` (see
    :meth:`rlnb.components.lm.actor.LMActor.sample_group`)."""
    rows = []
    groups = -(-b["input_ids"].shape[0] // size)
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < groups:
        raise IndexError(f"sample_group: expected a group in 0-{groups - 1} of this batch, got {group!r}")
    columns = torch.arange(b["input_ids"].shape[1])
    for i in range(group * size, min((group + 1) * size, b["input_ids"].shape[0])):
        response = b["response_mask"][i].bool()
        # after the prompt: the completion, or a multi-turn transcript (the interaction's replies between
        # the model's turns are attended to, out of the response mask)
        after = columns >= (int(response.nonzero()[0]) if response.any() else len(columns))
        attended = b["attention_mask"][i].bool()
        prompt = attended & ~after
        row = {
            "prompt": tok.decode(b["input_ids"][i][prompt], skip_special_tokens=True),
            # what the model was given, special tokens included (a chat template's turns and <bos>)
            "prompt_tokens": tok.decode(b["input_ids"][i][prompt]),
            "completion": tok.decode(b["input_ids"][i][attended & after], skip_special_tokens=True),
            "reward": float(b["rewards"][i]),
            "logprob": float(b["logprobs"][i][response].sum()),
        }
        if "truncated" in b:  # cut at max_new_tokens without ending
            row["truncated"] = bool(b["truncated"][i])
        if "reward_terms" in b:  # several rewards: each one's score
            row["rewards"] = dict(zip(b["reward_names"], b["reward_terms"][i].tolist()))
        if "advantages" in b:
            row["advantage"] = float(b["advantages"][i][response].mean()) if response.any() else 0.0
        rows.append(row)
    return rows
