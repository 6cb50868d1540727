"""Language-model helpers: a tiny causal LM built locally (no hub), loading by path, token log-probs.

Example:
    >>> path = build_tiny_lm("/tmp/tiny-lm", hidden_size=64, num_layers=2, num_heads=4)   # doctest: +SKIP
    >>> model, tok = load_lm(path)                                                        # doctest: +SKIP
"""

from __future__ import annotations

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


def load_lm(path: str | Path, device: str | torch.device = "cpu"):
    """``(model, tokenizer)`` from a local directory, with a clear error when it is missing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").exists():
        raise ConfigError(
            f"model path {str(path)!r} has no config.json: not a saved model. Build one with "
            "rlnb.models.build_tiny_lm(path) or point rollout.model_path at a save_pretrained directory",
            "model.path",
        )
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"  # generation appends on the right
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    return model, tok


def token_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-prob of each token given the ones before it: ``[B, L]`` (position 0 gets 0).

    ``input_ids [B, L]``, ``attention_mask [B, L]`` -> ``logprobs [B, L]``.
    """
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions
    ).logits  # (B, L, V)
    logits = logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, L-1)
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)
