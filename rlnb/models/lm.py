"""Language-model helpers: a tiny causal LM built locally (no hub), loading by path, token log-probs.

Example:
    >>> path = build_tiny_lm("/tmp/tiny-lm", hidden_size=64, num_layers=2, num_heads=4)   # doctest: +SKIP
    >>> model, tok = load_lm(path)                                                        # doctest: +SKIP
"""

from __future__ import annotations

import re
import string
from pathlib import Path

import torch

from rlnb.errors import ConfigError

# Characters of the arithmetic task and GSM8K-style text; one token each.
CHARS = string.digits + string.ascii_letters + " +-*/=().,?#\\{}$:;'\n"
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` made with ``tokenizers`` (no download)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )  # fmt: skip


def build_tiny_lm(
    path: str | Path, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, arch: str = "qwen2",
    max_positions: int = 128, seed: int = 0,
) -> Path:  # fmt: skip
    """Build a small causal LM from a ``transformers`` config and a local tokenizer; ``save_pretrained`` it.

    Args:
        arch: ``qwen2`` or ``llama``.
    Returns:
        The directory, loadable with :func:`load_lm` (``from_pretrained``), as a real checkpoint is.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_heads:
        raise ConfigError(
            f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}", "model.num_heads"
        )
    tok = build_char_tokenizer()
    cls_cfg, cls_model = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[
        arch
    ]
    config = cls_cfg(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=4 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, max_position_embeddings=max_positions,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = cls_model(config)
    path = Path(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: str | Path) -> bool:
    """Whether ``path`` names a Hugging Face hub model (``org/name``) rather than a local directory.

    As ``from_pretrained`` does, an existing local directory wins; otherwise ``org/name`` (one slash,
    not starting with ``.``, ``/`` or ``~``) is a hub id. Write ``./models/tiny`` for a local path of
    that shape that does not exist yet.
    """
    text = str(path)
    return not Path(text).expanduser().exists() and bool(_HUB_ID.match(text))


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
    if not (local / "config.json").exists():
        raise ConfigError(
            f"{key}: {str(path)!r} has no config.json: not a saved model. Build one with "
            "rlnb.models.build_tiny_lm(path) (or set actor.build_if_missing=true in a recipe), or point the "
            "key at a save_pretrained directory or a Hugging Face hub id",
            key,
        )
    return str(local)


def load_lm(path: str | Path, device: str | torch.device = "cpu", key: str = "actor.model_path"):
    """``(model, tokenizer)`` from a local ``save_pretrained`` directory or a hub id (``from_pretrained``),
    with a clear error naming ``key`` when neither is there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = resolve_model(path, key)
    tok = AutoTokenizer.from_pretrained(ref)
    tok.padding_side = "left"  # generation appends on the right
    if tok.pad_token_id is None:  # many hub tokenizers have none; generation and batching need one
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).to(device)
    return model, tok


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


def logits_kept(model, positions: int) -> dict:
    """``{"logits_to_keep": positions}`` for a model whose forward takes it (``transformers`` causal LMs
    since 4.50: logits of the last ``positions`` positions only), else ``{}`` (all of them)."""
    import inspect

    forward = getattr(model, "module", model).forward  # a DDP wrapper's model
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return {}
    takes = "logits_to_keep" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {"logits_to_keep": positions} if takes else {}


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
) -> torch.Tensor:
    """Log-prob of each token given the ones before it: ``[B, L]`` (position 0 gets 0).

    ``input_ids [B, L]``, ``attention_mask [B, L]`` -> ``logprobs [B, L]``. With ``from_column`` (a
    batch's first response column), logits are computed only for the positions scoring columns from
    there on (``logits_to_keep``, as TRL does: a large vocabulary's ``[B, L, V]`` logits of the prompts
    are most of the memory), and earlier columns get 0.
    """
    length = input_ids.shape[1]
    keep = length - max(from_column, 1) + 1  # logits of columns from_column - 1 .. L - 1
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions_from_mask(attention_mask),
        **(logits_kept(model, keep) if keep < length else {}),
    ).logits  # (B, keep or L, V)
    return _scored(logits[:, -keep:-1], input_ids, length - keep + 1, temperature)


def shared_prompt_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    min_saved_fraction: float = 0.0,
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
    sharing would save under ``min_saved_fraction`` of the batch's ``B x L`` token positions.

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
        position_ids=positions[first, :cut], past_key_values=cache, use_cache=True, **logits_kept(model, 1),
    )  # fmt: skip
    cache.batch_select_indices(inverse)  # (U, ...) -> (B, ...), differentiable
    logits = model(
        input_ids=input_ids[:, cut:],
        attention_mask=attention_mask,
        position_ids=positions[:, cut:],
        past_key_values=cache,
        use_cache=True,
    ).logits  # (B, L - cut, V)
    return _scored(logits[:, :-1], input_ids, cut + 1, temperature)
