"""Language-model helpers: a tiny causal LM built locally (no hub), loading by path, token log-probs.

Example:
    >>> path = build_tiny_lm("/tmp/tiny-lm", hidden_size=64, num_layers=2, num_heads=4)   # doctest: +SKIP
    >>> model, tok = load_lm(path)                                                        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import string
from pathlib import Path

import torch

from rlnb.errors import ConfigError

# Characters of the arithmetic task and GSM8K-style text; one token each.
CHARS = string.digits + string.ascii_letters + " +-*/=().,?#\\{}$:;'\n"
# what a tool call's JSON needs besides (``<tool_call>{"name": ...}</tool_call>``): a tiny LM built for tools has them
TOOL_CHARS = '<>"[]_'
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]


# an instruct model's chat template in the tiny tokenizer's characters: a system line, "Q: " turns, "A: " answers; with
# tools, a "Tools: " line naming them, and tool messages as "R: " lines (calls: <tool_call>{json}</tool_call>)
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ 'Tools: ' }}{% for t in tools %}{{ t['function']['name'] }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ '\\n' }}{% endif %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] + '\\n' }}"
    "{% elif m['role'] == 'user' %}{{ 'Q: ' + m['content'] + '\\n' }}"
    "{% elif m['role'] == 'tool' %}{{ 'R: ' + m['content'] + '\\n' }}"
    "{% else %}{{ 'A: ' + m['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
)


def build_char_tokenizer(add_bos: bool = False, extra_chars: str = ""):
    """A character-level ``PreTrainedTokenizerFast`` made with ``tokenizers`` (no download). ``add_bos``: it
    starts each encoded text with ``<bos>`` unless called with ``add_special_tokens=False``, as Llama's does
    (Qwen2's adds nothing). ``extra_chars``: characters beyond :data:`CHARS` (:data:`TOOL_CHARS` for tool calls),
    after them: the others keep their ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + list(CHARS) + [c for c in extra_chars if c not in CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )  # fmt: skip


def build_tiny_lm(
    path: str | Path, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, arch: str = "qwen2",
    max_positions: int = 128, seed: int = 0, dtype: str = "float32", device: str = "cpu", extra_chars: str = "",
) -> Path:  # fmt: skip
    """Build a small causal LM from a ``transformers`` config and a local tokenizer; ``save_pretrained`` it.

    Args:
        arch: ``qwen2`` or ``llama`` (whose tokenizer, as Llama's, starts each text with ``<bos>``).
        dtype: the precision the weights are made and saved in (:data:`DTYPES`): ``bfloat16`` halves the files
            of a model of billions of parameters, as real checkpoints are published.
        device: where the weights are initialised before saving (``cuda`` makes a 7B model in seconds).
        extra_chars: the tokenizer's characters beyond :data:`CHARS` (:data:`TOOL_CHARS`: tool calls).
    Returns:
        The directory, loadable with :func:`load_lm` (``from_pretrained``), as a real checkpoint is.
    """
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    config, tok = tiny_lm_config(hidden_size, num_layers, num_heads, arch, max_positions, extra_chars)
    cls_model = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}[arch]
    return _save_new(cls_model, config, tok, path, seed, dtype, device)


def tiny_lm_config(
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    arch: str = "qwen2",
    max_positions: int = 128,
    extra_chars: str = "",
):
    """``(config, tokenizer)`` of the tiny LM :func:`build_tiny_lm` makes, without making it (what
    :mod:`rlnb.loop.families.grpo.plan` sizes before a recipe builds one)."""
    from transformers import LlamaConfig, Qwen2Config

    if hidden_size % num_heads:
        raise ConfigError(
            f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}", "model.num_heads"
        )
    tok = build_char_tokenizer(add_bos=arch == "llama", extra_chars=extra_chars)  # (each family's habit)
    tok.chat_template = TINY_CHAT_TEMPLATE
    cls_cfg = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    config = cls_cfg(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=4 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, max_position_embeddings=max_positions,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )  # fmt: skip
    return config, tok


TINY_LM_RECORD = "rlnb_tiny_lm.json"
"""The file a recipe's ``actor.build_if_missing`` leaves beside the tiny LM it built: the shape it was built with
(``actor.tiny_lm``'s fields), so that a later recipe asking another shape of the same ``actor.model_path`` is
told rather than ignored (a model made otherwise, by :func:`build_tiny_lm` or a release, has none)."""


def tiny_lm_shape(tiny) -> dict:
    """``actor.tiny_lm``'s fields (a :class:`rlnb.config.schema.TinyLMConfig`) as :data:`TINY_LM_RECORD` keeps them."""
    return {
        "arch": tiny.arch,
        "hidden_size": tiny.hidden_size,
        "num_layers": tiny.num_layers,
        "num_heads": tiny.num_heads,
        "max_positions": tiny.max_positions,
    }


def tiny_lm_mismatch(path: str | Path, wanted: dict) -> str | None:
    """Why the tiny LM built at ``path`` is not the one ``wanted`` (``actor.tiny_lm``'s fields), or ``None``
    (the same, or no model there that a recipe built: another is not the recipe's to compare)."""
    record = Path(path) / TINY_LM_RECORD
    if not record.is_file():
        return None
    try:
        built = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    built.setdefault("max_positions", 128)  # (a record from before the setting: the size it was built with)
    differ = {k: (built.get(k), v) for k, v in wanted.items() if built.get(k) != v}
    if not differ:
        return None
    said = ", ".join(f"{k}={v!r} (the model there: {b!r})" for k, (b, v) in differ.items())
    return (
        f"actor.tiny_lm: {said}; the tiny LM at actor.model_path={path} was built earlier with another shape. "
        "Point actor.model_path at a new directory to build this one (or remove the old), or drop the "
        "actor.tiny_lm overrides to train the one there"
    )


def _save_new(
    cls_model, config, tok, path: str | Path, seed: int, dtype: str = "float32", device="cpu"
) -> Path:
    """A model of ``cls_model`` initialised from ``seed`` in ``dtype`` on ``device``, saved with ``tok`` in ``path``."""
    check_dtype(dtype)
    torch.manual_seed(seed)
    with torch.device(device):  # (from_config, as AutoModel's: the config records the dtype made)
        model = cls_model._from_config(config, dtype=DTYPES[dtype])
    path = Path(path)
    with hf_quiet():
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return path


@contextlib.contextmanager
def hf_quiet():
    """``transformers``' own progress bars ("Loading weights", "Writing model shards") off while rlnb loads or
    writes a model, then as they were: on workers, every rank's bars would interleave in the driver's terminal,
    where rlnb shows its own progress. ``RLNB_HF_PROGRESS=1`` keeps them."""
    from transformers.utils import logging as hf_logging

    if os.environ.get("RLNB_HF_PROGRESS", "").strip().lower() in ("1", "true", "yes", "on"):
        yield
        return
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def build_tiny_reward_model(
    path: str | Path, hidden_size: int = 32, num_layers: int = 1, num_heads: int = 2, seed: int = 0
) -> Path:
    """Build a small reward model, a Qwen2-style sequence classifier with one output (a score), on the tiny LMs'
    character tokenizer; ``save_pretrained`` it. Random weights: it scores texts, arbitrarily but
    deterministically, as a trained one would score them for real (for :class:`rlnb.algorithms.RewardModel`).
    """
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=4 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, max_position_embeddings=256, num_labels=1,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    return _save_new(Qwen2ForSequenceClassification, config, tok, path, seed)


def load_reward_model(path: str | Path, device: str | torch.device = "cpu", key: str = "reward.model_path"):
    """``(model, tokenizer)`` of a sequence-classification reward model, from a local ``save_pretrained``
    directory or a hub id, in eval mode; texts are padded on the right (the model scores each at its last token)."""
    from transformers import AutoModelForSequenceClassification

    ref = resolve_model(path, key)
    tok = load_tokenizer(ref)
    tok.padding_side = "right"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    with hf_quiet():
        model = AutoModelForSequenceClassification.from_pretrained(ref, dtype=torch.float32).to(device)
    if model.config.pad_token_id is None:  # (it finds each text's last token by the pad id)
        model.config.pad_token_id = tok.pad_token_id
    return model.eval().requires_grad_(False), tok


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""Declared in ``tokenizer_config.json`` by a tokenizer saved from ``tokenizers`` itself (rlnb's tiny ones)."""


def load_tokenizer(ref: str):
    """The tokenizer of a model directory or hub id, as ``AutoTokenizer`` loads it, but as declared where its
    ``tokenizer_config.json`` names the generic ``tokenizers`` class: ``transformers`` 5 would otherwise load
    the model type's own class (``Qwen2Tokenizer`` for a ``qwen2`` model), whose built-in pre-tokenizer
    replaces the saved one (the tiny character tokenizer then drops every space and line break)."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(ref) / "tokenizer_config.json"
    declared = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if declared in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(ref)
    return AutoTokenizer.from_pretrained(ref)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: str | Path) -> bool:
    """Whether ``path`` names a Hugging Face hub model (``org/name``) rather than a local directory.

    As ``from_pretrained`` does, an existing local directory wins; otherwise ``org/name`` (one slash,
    not starting with ``.``, ``/`` or ``~``) is a hub id. Write ``./models/tiny`` for a local path of
    that shape that does not exist yet.
    """
    text = str(path)
    return not _exists(Path(text).expanduser()) and bool(_HUB_ID.match(text))


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # e.g. a name too long for the file system: nothing there
        return False


def near_miss(path: Path, key: str = "actor.model_path") -> list[str]:
    """A ``model_path`` with no model, beside a model directory of a close name, is a typo: an error naming
    ``key`` (rather than an untrained model built and trained in its place, ``actor.build_if_missing``)."""
    from rlnb.errors import did_you_mean

    parent = path.parent
    if _exists(path / "config.json") or not parent.is_dir():
        return []
    models = [p.name for p in parent.iterdir() if _exists(p / "config.json") and p.name != path.name]
    close = did_you_mean(path.name, models)
    if not close:
        return []
    return [
        f"{key}: no model at {path}, and actor.build_if_missing would build an untrained one there.{close} "
        "(To build a new one beside it, choose a name less like another model's.)"
    ]


def resolve_model(path: str | Path, key: str = "actor.model_path") -> str:
    """A loadable model reference: a local ``save_pretrained`` directory (absolute), or a hub id that
    ``from_pretrained`` can load here (the local Hugging Face cache, or the hub when online).

    Raises:
        ConfigError: naming ``key``, when neither works (e.g. offline and not in the cache).
    """
    if is_hub_id(path):
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{key}: {str(path)!r} is not a local directory and could not be loaded as a Hugging Face "
                f"hub id ({type(e).__name__}: {str(e).splitlines()[0]}). Offline, download it on a connected "
                f"machine first (`huggingface-cli download {path}`, then copy the cache or the folder), or "
                "point the key at a save_pretrained directory",
                key,
            ) from None
        return str(path)
    local = Path(path).expanduser().resolve()
    if not _exists(local / "config.json"):
        raise ConfigError(
            f"{key}: {str(path)!r} has no config.json: not a saved model. Build one with "
            "rlnb.models.build_tiny_lm(path) (or set actor.build_if_missing=true in a recipe), or point the "
            "key at a save_pretrained directory or a Hugging Face hub id",
            key,
        )
    return str(local)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The precisions an LM component takes (``actor.dtype``), by name."""


def check_dtype(dtype: str, key: str = "dtype") -> str:
    """``dtype`` if it names a precision an LM component takes (:data:`DTYPES`), else a :class:`ConfigError`
    naming ``key``."""
    if dtype not in DTYPES:
        raise ConfigError(f"{key}: expected one of {sorted(DTYPES)}, got {dtype!r}", key)
    return dtype


def load_lm(
    path: str | Path,
    device: str | torch.device = "cpu",
    key: str = "actor.model_path",
    dtype: str = "float32",
    empty: bool = False,
):
    """``(model, tokenizer)`` from a local ``save_pretrained`` directory or a hub id (``from_pretrained``),
    with a clear error naming ``key`` when neither is there; weights in ``dtype`` (a name of :data:`DTYPES`).
    ``empty``: the model with no storage (the meta device), for a sharded actor that reads its shards itself
    (:mod:`rlnb.components.lm.shard_load`)."""
    from transformers import AutoModelForCausalLM

    ref = resolve_model(path, key)
    tok = load_tokenizer(ref)
    tok.padding_side = "left"  # generation appends on the right
    if tok.pad_token_id is None:  # many hub tokenizers have none; generation and batching need one
        tok.pad_token = tok.eos_token
    if empty:
        return empty_lm(ref, dtype), tok
    with hf_quiet():
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=DTYPES[dtype]).to(device)
    return model, tok


def empty_lm(ref: str, dtype: str = "float32") -> torch.nn.Module:
    """The causal LM of ``ref`` (a model directory) with no storage: every parameter and buffer on the meta device,
    in ``dtype`` (a name of :data:`DTYPES`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ref)
    with torch.device("meta"), hf_quiet():
        return AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])


def prompt_ids(tok, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids: with the tokenizer's special tokens (a Llama tokenizer's ``<bos>``), unless the text
    starts with its ``<bos>`` already, as a chat template's output does (``apply_chat_template``): tokenizing it
    with them would double it. The one tokenization of prompts for generation and the warm start alike. A list of
    token ids is taken as it is."""
    if isinstance(prompt, list):  # token ids already (a multi-turn rollout's transcript so far)
        return list(prompt)
    bos = tok.bos_token
    return tok(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))["input_ids"]


def encode_prompts(tok, prompts: list[str]):
    """:func:`prompt_ids` of each prompt, padded on the tokenizer's side: ``input_ids`` and ``attention_mask``
    ``[B, P]`` tensors (a ``BatchEncoding``)."""
    return tok.pad({"input_ids": [prompt_ids(tok, p) for p in prompts]}, return_tensors="pt")


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows, as ``generate`` counts them: ``[B, L]`` -> ``[B, L]``."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def new_cache(model):
    """An empty ``transformers`` ``DynamicCache`` for ``model`` (or the model a DDP wrapper holds)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=getattr(model, "module", model).config)
    except TypeError:  # transformers < 4.56 builds it without the config
        return DynamicCache()


def enable_checkpointing(model) -> None:
    """``transformers``' activation (gradient) checkpointing, non-reentrant (the recomputed forward sees the same
    autocast and RNG state): ``activation_checkpointing_enable`` from 5.24, ``gradient_checkpointing_enable``
    before it."""
    new = getattr(model, "activation_checkpointing_enable", None)
    if new is not None:
        new(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def base_lm(model):
    """The ``transformers`` model under rlnb's and others' wrappers: DDP (``.module``), the LoRA reference view
    (``.lm``), PEFT (``get_base_model()``)."""
    model = getattr(model, "module", model)
    model = model.__dict__.get("lm", model)
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def cache_kwarg(model, cache) -> dict:
    """The KV ``cache`` as ``model``'s forward (and ``generate``) takes it: ``{"cache": cache}`` where the forward
    names it so (``transformers`` from 5.24, which deprecates ``past_key_values``), else
    ``{"past_key_values": cache}``."""
    return {_cache_name(type(base_lm(model))): cache}


@functools.lru_cache(maxsize=64)
def _cache_name(cls: type) -> str:
    import inspect

    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _forward_takes(model, name: str) -> bool:
    """Whether ``model``'s forward (under its wrappers: what they pass their keywords on to) takes ``name``."""
    import inspect

    try:
        params = inspect.signature(base_lm(model).forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def logits_kept(model, positions: int) -> dict:
    """``{"logits_to_keep": positions}`` for a model whose forward takes it (``transformers`` causal LMs
    since 4.50: logits of the last ``positions`` positions only), else ``{}`` (all of them)."""
    return {"logits_to_keep": positions} if _forward_takes(model, "logits_to_keep") else {}


def no_cache(model) -> dict:
    """``{"use_cache": False}`` for a model whose forward takes it: a forward nothing follows keeps no KV cache
    (and under activation checkpointing ``transformers`` would warn that it turned the cache off), else ``{}``."""
    return {"use_cache": False} if _forward_takes(model, "use_cache") else {}


def first_response_column(response_mask: torch.Tensor) -> int:
    """The first column holding a response token in any row of ``response_mask [B, L]`` (1 if none)."""
    in_response = response_mask.bool().any(0).nonzero()
    return int(in_response[0]) if len(in_response) else 1


def _scored(logits: torch.Tensor, input_ids: torch.Tensor, column: int, temperature: float) -> torch.Tensor:
    """``[B, L]`` log-probs of ``input_ids``' columns ``column..L-1`` from ``logits [B, L - column, V]``
    (the positions before them), and 0 before ``column``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp.gather(-1, input_ids[:, column:, None]).squeeze(-1)  # (B, L - column)
    return torch.cat([logp.new_zeros(len(input_ids), column), logp], dim=1)


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    from_column: int = 1,
    max_buckets: int = 1,
) -> torch.Tensor:
    """Log-prob of each token given the ones before it: ``[B, L]`` (position 0 gets 0).

    ``input_ids [B, L]``, ``attention_mask [B, L]`` -> ``logprobs [B, L]``. With ``from_column`` (a
    batch's first response column), logits are computed only for the positions scoring columns from
    there on (``logits_to_keep``, as TRL does: a large vocabulary's ``[B, L, V]`` logits of the prompts
    are most of the memory), and earlier columns get 0. With ``max_buckets > 1``, rows go through in up
    to that many passes grouped by where their tokens end (:func:`length_buckets`), each pass cut at its
    longest row: the columns past a pass's longest row get 0 (padding, which a loss masks).
    """
    length = input_ids.shape[1]
    start = max(from_column, 1) - 1  # the first column whose logits are kept
    buckets = length_buckets(token_ends(attention_mask, start + 2), start, max_buckets)
    if buckets is None:
        return _token_logprobs_upto(model, input_ids, attention_mask, temperature, start, length)
    pieces = [
        _token_logprobs_upto(model, input_ids[rows], attention_mask[rows], temperature, start, end)
        for rows, end in buckets
    ]
    return _unbucket(pieces, buckets, length)


def _token_logprobs_upto(model, input_ids, attention_mask, temperature: float, start: int, end: int):
    """:func:`token_logprobs` of columns ``start + 1 .. end - 1`` (0 elsewhere): ``[B, end]``."""
    ids, attn = input_ids[:, :end], attention_mask[:, :end]
    keep = end - start  # logits of columns start .. end - 1
    logits = model(
        input_ids=ids,
        attention_mask=attn,
        position_ids=positions_from_mask(attn),
        **no_cache(model),
        **(logits_kept(model, keep) if keep < end else {}),
    ).logits  # (B, keep or end, V)
    return _scored(logits[:, -keep:-1], ids, start + 1, temperature)


def packed_token_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
):
    """:func:`token_logprobs` with the rows packed into one sequence and no padding computed: ``[B, L]`` (0 at
    each row's first token and on padding). The attended tokens of every row, one after the other, go through the
    model as ``[1, T]`` with position ids restarting at each row and no attention mask, which ``transformers``
    reads as packed sequences (each attends within its own row: ``masking_utils.find_packed_sequence_indices``;
    veRL's remove-padding, TRL's ``padding_free``). A model that does not read them so attends across rows:
    :meth:`rlnb.components.LMActor` checks the two paths agree before it packs."""
    attended = attention_mask.bool()
    flat = input_ids[attended][None]  # [1, T], row after row
    positions = positions_from_mask(attention_mask)[attended][None]
    logits = model(input_ids=flat, position_ids=positions, attention_mask=None, **no_cache(model)).logits[0]
    logp = torch.log_softmax(logits[:-1].float() / temperature, dim=-1)
    nxt = logp.gather(-1, flat[0, 1:, None]).squeeze(-1)  # [T - 1]: token k + 1 given those before it
    scored = torch.cat([nxt.new_zeros(1), nxt])  # [T]: token k's log-prob (meaningless at a row's first)
    scored = torch.where(positions[0] > 0, scored, torch.zeros_like(scored))
    out = scored.new_zeros(input_ids.shape)
    out[attended] = scored
    return out


def pack_rows(attention_mask: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Rows in order, grouped so that each group's attended tokens sum to at most ``max_tokens`` (a longer row
    alone): the micro-batches of ``actor.max_tokens_per_micro_batch``. ``[B, L]`` -> index tensors."""
    lengths = attention_mask.sum(-1).tolist()
    groups, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > max_tokens:
            groups.append(torch.tensor(current))
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(torch.tensor(current))
    return groups


def token_ends(attention_mask: torch.Tensor, least: int = 0) -> torch.Tensor:
    """Where each row's tokens end, one past its last attended column, and at least ``least``: ``[B]``.
    A generated row is right-padded after its EOS; a prompt is left-padded."""
    length = attention_mask.shape[1]
    attended = attention_mask.bool()
    last = torch.where(
        attended.any(-1), length - attended.flip(-1).long().argmax(-1), 0
    )  # one past the last 1
    return last.clamp(min=least, max=length)


def length_buckets(
    ends: torch.Tensor, start: int, max_buckets: int, cost_positions: int = 64
) -> list[tuple[torch.Tensor, int]] | None:
    """Rows grouped by where they end, so that each group can go through a model cut at its longest row.

    ``ends [B]`` (:func:`token_ends`) -> ``[(rows, end)]``: at most ``max_buckets`` groups minimising the
    token positions computed, ``sum(len(rows) * (end - start))``, plus ``cost_positions`` for each pass
    (its fixed cost: dispatch, weights read again; measured in positions, ``docs/benchmarks.md``). ``None`` when one pass
    over the whole width is best or ``max_buckets < 2``. veRL removes padding by packing rows (``use_remove_padding``); cutting passes
    at their longest row gets most of that without a variable-length attention kernel.

    Example:
        >>> length_buckets(torch.tensor([40, 12, 40, 11] * 32), start=4, max_buckets=4)  # doctest: +SKIP
        [(tensor([1, 3, ...]), 12), (tensor([0, 2, ...]), 40)]
    """
    if max_buckets < 2 or len(ends) < 2:
        return None
    values, counts = torch.unique(ends, return_counts=True)  # ascending
    if len(values) > 64:  # the search below is quadratic in distinct ends: round them up onto 64 steps
        step = -(-int(ends.max() - ends.min()) // 64)
        ends = torch.minimum(ends.min() + (ends - ends.min() + step - 1) // step * step, ends.max())
        values, counts = torch.unique(ends, return_counts=True)
    if len(values) < 2:
        return None
    v = (values - start).tolist()
    below = [0, *torch.cumsum(counts, 0).tolist()]  # rows ending at or before each value
    m = len(v)
    inf = float("inf")
    # best[k][j]: the least cost of the first j distinct ends in k passes; cut[k][j]: where its last one starts
    best = [[0.0] + [inf] * m]
    cut: list[list[int]] = [[0] * (m + 1)]
    for k in range(1, max_buckets + 1):
        row, back = [inf] * (m + 1), [0] * (m + 1)
        for j in range(1, m + 1):
            for i in range(j):
                c = best[k - 1][i] + (below[j] - below[i]) * v[j - 1] + cost_positions
                if c < row[j]:
                    row[j], back[j] = c, i
        best.append(row)
        cut.append(back)
    k = min(range(1, max_buckets + 1), key=lambda n: best[n][m])
    if k == 1:
        return None
    bounds, j = [], m
    for n in range(k, 0, -1):
        i = cut[n][j]
        bounds.append((values[i - 1].item() if i else -1, values[j - 1].item()))
        j = i
    out = []
    for low, high in reversed(bounds):
        members = ((ends > low) & (ends <= high)).nonzero().squeeze(1)
        out.append((members, int(high)))
    return out


def _unbucket(
    pieces: list[torch.Tensor], buckets: list[tuple[torch.Tensor, int]], length: int
) -> torch.Tensor:
    """Each bucket's ``[rows, end]`` log-probs back in the batch's row order, zero-padded to ``[B, length]``."""
    padded = torch.cat([torch.nn.functional.pad(p, (0, length - p.shape[1])) for p in pieces])
    order = torch.cat([rows for rows, _ in buckets])
    return padded[torch.argsort(order)]


def shared_prompt_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    min_saved_fraction: float = 0.0,
    max_buckets: int = 1,
) -> torch.Tensor | None:
    """:func:`token_logprobs` at the response positions, with each distinct prompt computed once.

    A GRPO batch holds each prompt ``group_size`` times. The columns before the first response token
    (but the last, whose logits score it) are a prefix: its distinct rows go through the model once,
    their KV cache is repeated for every row sharing them, and only the rest of each row, with logits
    for it alone, goes through per row. Gradients flow through the shared prefix as through the plain
    forward, so the values and their gradients are :func:`token_logprobs`'s (up to float rounding)
    from the first response column on; columns before it get 0 (a loss masks them).

    ``input_ids``, ``attention_mask``, ``response_mask`` ``[B, L]`` -> ``logprobs [B, L]``, or ``None``
    when there is nothing to share (no two rows with the same prefix, or a prefix under 2 columns), or
    sharing would save under ``min_saved_fraction`` of the batch's ``B x L`` token positions. With
    ``max_buckets > 1`` the rows' remaining columns go through in up to that many passes grouped by where
    they end, as in :func:`token_logprobs`, each from the same shared prefix.

    Example:
        >>> logp = shared_prompt_logprobs(model, ids, attn, response_mask)   # doctest: +SKIP
    """
    # the prefix: columns [0, cut); the token at `cut` scores the first response column
    cut = first_response_column(response_mask) - 1
    if cut < 2:  # no response (column 1 then), or too short a prompt to share
        return None
    prefix_key = torch.where(attention_mask[:, :cut].bool(), input_ids[:, :cut], -1)
    unique, inverse = torch.unique(prefix_key, dim=0, return_inverse=True)  # (U, cut), (B,)
    rows = len(input_ids)
    if len(unique) == rows or (rows - len(unique)) * cut < min_saved_fraction * input_ids.numel():
        return None
    first = torch.full((len(unique),), rows, device=inverse.device)  # one row holding each distinct prefix
    first = first.scatter_reduce(0, inverse, torch.arange(rows, device=inverse.device), reduce="amin")
    positions = positions_from_mask(attention_mask)
    cache = new_cache(model)
    # only the prefix's cache is used: logits for one position, not all of its own
    model(
        input_ids=input_ids[first, :cut], attention_mask=attention_mask[first, :cut],
        position_ids=positions[first, :cut], use_cache=True, **cache_kwarg(model, cache), **logits_kept(model, 1),
    )  # fmt: skip
    length = input_ids.shape[1]
    buckets = length_buckets(token_ends(attention_mask, cut + 2), cut, max_buckets)
    if buckets is None or not hasattr(cache, "layers"):  # one pass (a cache without per-layer tensors too)
        cache.batch_select_indices(inverse)  # (U, ...) -> (B, ...), differentiable
        return _rest_logprobs(model, input_ids, attention_mask, positions, cache, cut, length, temperature)
    pieces = []
    for rows, end in buckets:
        part = new_cache(model)
        for i, layer in enumerate(cache.layers):  # the bucket's rows of every layer's prefix keys and values
            part.update(layer.keys[inverse[rows]], layer.values[inverse[rows]], i)
        pieces.append(
            _rest_logprobs(
                model, input_ids[rows], attention_mask[rows], positions[rows], part, cut, end, temperature
            )
        )
    return _unbucket(pieces, buckets, length)


def _rest_logprobs(
    model, input_ids, attention_mask, positions, cache, cut: int, end: int, temperature: float
):
    """Columns ``cut .. end - 1`` through ``model`` after the prefix in ``cache``: log-probs ``[B, end]``,
    0 before column ``cut + 1``."""
    logits = model(
        input_ids=input_ids[:, cut:end],
        attention_mask=attention_mask[:, :end],
        position_ids=positions[:, cut:end],
        use_cache=True,
        **cache_kwarg(model, cache),
    ).logits  # (B, end - cut, V)
    return _scored(logits[:, :-1], input_ids[:, :end], cut + 1, temperature)
