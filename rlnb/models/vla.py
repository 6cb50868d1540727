"""Vision-language-action policies on ``transformers`` vision-language models: camera image(s) + an instruction
(+ proprioception) -> an action, with a value head for PPO.

Two action heads, as the released VLAs have them:

- ``tokens`` (OpenVLA): each action dimension is binned into ``action_bins`` reserved tokens of the vocabulary and
  decoded one token per dimension after the prompt; the log-probability of an action is the sum over its tokens
  (each a softmax over the bin tokens only, as RL fine-tunings of OpenVLA score them). A ``Discrete(n)`` action is
  one token of ``n``.
- ``chunk`` (OpenVLA-OFT): a Gaussian over a chunk of future actions, its mean a linear map of the prompt's last
  hidden state (and the proprioception), its standard deviation a learned parameter.

The proprioception reaches the action as a linear term in each token's logits (``proprio="logits"``), or, as
OpenVLA-OFT's proprio projector, as one input embedding at the prompt's end that the decoder reads
(``proprio="token"``).

The value head reads the prompt's last hidden state and the proprioception. The prompt is PaliGemma's layout (the
image tokens, ``<bos>``, the text) with OpenVLA's question, so a released checkpoint of either kind reads what it
was trained on. Images are resized and normalised with torch (no torchvision), as the model's processor would.

Shapes: ``B`` observations, ``N`` images each, ``L`` prompt tokens, ``D`` action dimensions, ``K`` the chunk.

Example:
    >>> path = build_tiny_vla("/tmp/tiny-vla", image_size=20, patch_size=4)          # doctest: +SKIP
    >>> model, processor = load_vla(path)                                           # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from rlnb.config.schema import VLAHead, VLAProprio
from rlnb.errors import ConfigError

ACTION_TOKEN = "<act{}>"
IMAGE_TOKEN = "<image>"
# OpenVLA's prompt (its ``prismatic`` VLA's), the instruction lower-cased as it does
PROMPT = "In: What action should the robot take to {instruction}?\nOut:"
HEADS = typing.get_args(VLAHead)
PROPRIO = typing.get_args(VLAProprio)
# what rlnb writes beside a tiny VLA: how its actions are tokenised (a released OpenVLA says the same in its config)
VLA_FILE = "rlnb_vla.json"


def build_tiny_vla(
    path: str | Path, image_size: int = 64, patch_size: int = 16, hidden_size: int = 64, num_layers: int = 2,
    num_heads: int = 2, action_bins: int = 256, seed: int = 0, action_tokens: str = "named",
) -> Path:  # fmt: skip
    """Build a small PaliGemma (a SigLIP vision tower and a Gemma decoder) with random weights and a local
    tokenizer (the tiny LM's characters, ``<image>`` and ``action_bins`` action tokens ``<act0>`` ...), and
    ``save_pretrained`` it with its processor, as a released VLM is laid out (no download).

    Args:
        image_size: the side the processor resizes camera images to, in pixels.
        patch_size: the vision tower's patch side; ``(image_size / patch_size) ** 2`` image tokens a camera.
        hidden_size, num_layers, num_heads: of both the vision tower and the decoder.
        action_bins: the action tokens: bins a continuous action dimension is cut into.
        action_tokens: ``named`` (``<act0>``... in the tokenizer) or ``last``, as a released OpenVLA lays them
            out: the vocabulary's last ``action_bins`` tokens, said by ``n_action_bins`` in the config.
    Returns:
        The directory, loadable with :func:`load_vla` (``AutoModelForImageTextToText.from_pretrained``).
    """
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipVisionConfig,
    )

    from rlnb.models.lm import build_char_tokenizer, hf_quiet

    checks = (
        ("image_size", 4 <= image_size <= 1024, "in [4, 1024]"),
        (
            "patch_size",
            1 <= patch_size <= image_size and image_size % patch_size == 0,
            "a divisor of image_size",
        ),
        ("num_heads", num_heads >= 1 and hidden_size % num_heads == 0, "a divisor of hidden_size"),
        ("action_bins", 2 <= action_bins <= 1024, "in [2, 1024]"),
        ("action_tokens", action_tokens in ("named", "last"), "named or last"),
    )
    for key, ok, expected in checks:
        if not ok:
            value = {"image_size": image_size, "patch_size": patch_size, "num_heads": num_heads,
                     "action_bins": action_bins, "action_tokens": action_tokens}[key]  # fmt: skip
            raise ConfigError(
                f"build_tiny_vla: {key}: expected {expected}, got {value}", f"actor.model.vla.tiny.{key}"
            )
    tok = build_char_tokenizer(add_bos=False)
    name = ACTION_TOKEN if action_tokens == "named" else "<unused{}>"  # (OpenVLA's: tokens it never wrote)
    tok.add_special_tokens(
        {"additional_special_tokens": [IMAGE_TOKEN] + [name.format(i) for i in range(action_bins)]}
    )
    image_tokens = (image_size // patch_size) ** 2
    vision = SiglipVisionConfig(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, image_size=image_size, patch_size=patch_size,
    )  # fmt: skip
    text = GemmaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=1,
        head_dim=hidden_size // num_heads, max_position_embeddings=image_tokens + 256,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    config = PaliGemmaConfig(
        vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        projection_dim=hidden_size, **({"n_action_bins": action_bins} if action_tokens == "last" else {}),
    )  # fmt: skip
    torch.manual_seed(seed)
    with hf_quiet():
        model = PaliGemmaForConditionalGeneration(config)
        processor = PaliGemmaProcessor(
            image_processor=_image_processor(image_size, image_tokens), tokenizer=tok
        )

    path = Path(path)
    with hf_quiet():
        model.save_pretrained(path)
        processor.save_pretrained(path)
    if action_tokens == "named":
        (path / VLA_FILE).write_text(json.dumps({"action_token": ACTION_TOKEN, "action_bins": action_bins}))
    return path


def _image_processor(image_size: int, image_tokens: int):
    """SigLIP's image processor, without the torchvision backend it would warn about (the PIL one)."""
    try:
        from transformers import SiglipImageProcessorPil as Processor
    except ImportError:  # (transformers before the backends were split)
        from transformers import SiglipImageProcessor as Processor
    processor = Processor(size={"height": image_size, "width": image_size})
    processor.image_seq_length = image_tokens
    return processor


@dataclasses.dataclass(frozen=True)
class VLASpec:
    """What a policy needs to know of a loaded VLA: its image tokens and preprocessing, its action tokens."""

    image_token_id: int
    image_seq_length: int  # image tokens a camera
    image_size: tuple[int, int]  # (height, width) the processor resizes to
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale: float
    resample: str  # "bilinear" or "bicubic", as the processor's PIL filter
    action_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int


def vla_spec(config, processor, key: str = "actor.model.vla.path") -> VLASpec:
    """Read a :class:`VLASpec` off a VLA's config (``model.config``, or ``AutoConfig``'s without the weights) and
    processor; a :class:`~rlnb.errors.ConfigError` naming ``key`` when they are not a vision-language model with
    action tokens."""
    tok = getattr(processor, "tokenizer", None)
    ip = getattr(processor, "image_processor", None)
    image_token_id = getattr(config, "image_token_id", getattr(config, "image_token_index", None))
    if tok is None or ip is None or image_token_id is None:
        raise ConfigError(
            f"{key}: expected a vision-language model and its processor (a tokenizer and an image processor), "
            f"got {type(config).__name__} with {type(processor).__name__}",
            key,
        )
    ids = []
    vocab = tok.get_vocab()
    for i in range(4096):
        t = ACTION_TOKEN.format(i)
        if t not in vocab:
            break
        ids.append(vocab[t])
    if not ids:  # a released OpenVLA: its 256 action bins are the vocabulary's last tokens
        bins = int(getattr(config, "n_action_bins", 0) or 0)
        if not bins:
            raise ConfigError(
                f"{key}: expected a VLA's action tokens ({ACTION_TOKEN.format(0)}... in the tokenizer, or "
                f"n_action_bins in the config as OpenVLA has it), found neither",
                key,
            )
        size = config.get_text_config().vocab_size
        ids = list(range(size - bins, size))
    size = ip.size
    side = (size["height"], size["width"]) if "height" in size else (size["shortest_edge"],) * 2
    seq = getattr(processor, "image_seq_length", None) or getattr(ip, "image_seq_length", None)
    if not seq:
        raise ConfigError(f"{key}: the processor does not say how many tokens an image takes", key)
    return VLASpec(
        image_token_id=int(image_token_id), image_seq_length=int(seq), image_size=(int(side[0]), int(side[1])),
        image_mean=tuple(float(x) for x in ip.image_mean), image_std=tuple(float(x) for x in ip.image_std),
        rescale=float(getattr(ip, "rescale_factor", 1 / 255)), action_token_ids=tuple(ids),
        resample="bicubic" if int(getattr(ip, "resample", 2) or 2) == 3 else "bilinear",  # (PIL's BICUBIC is 3)
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
    )  # fmt: skip


def load_vla(path: str | Path, device: str | torch.device = "cpu", key: str = "actor.model.vla.path",
             weights: bool = True):  # fmt: skip
    """A VLA's model and processor from a ``save_pretrained`` directory (or a hub id where there is a network):
    ``(model, processor)``, the model in eval mode on ``device``. ``weights=False``: its config in the model's
    place (what the checks before launch read, without loading the weights)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from rlnb.models.lm import hf_quiet, resolve_model

    ref = resolve_model(path, key)
    try:
        with hf_quiet():
            processor = AutoProcessor.from_pretrained(ref)
            if getattr(processor, "image_processor", None) is None:
                raise ConfigError(
                    f"{key}: expected a vision-language model directory (a processor with an image processor), "
                    f"{ref} has a {type(processor).__name__}",
                    key,
                )
            if not weights:
                return AutoConfig.from_pretrained(ref), processor
            model = AutoModelForImageTextToText.from_pretrained(ref)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{key}: expected a vision-language model directory, {ref} gave: {e}", key) from e
    return model.to(device).eval(), processor


def check_vla(obs_space: gym.Space, act_space: gym.Space, spec: VLASpec | None, head: str = "tokens",
              cameras=(), instruction: str = "", default_instruction: str = ""):  # fmt: skip
    """Refuse, naming the key, observations or actions this VLA cannot take: no camera image, cameras of
    another size or name, no instruction, an action space its head cannot express (its action tokens: with
    ``spec``; ``None`` checks the rest, before a model is there). Returns ``(layout, the cameras read, the
    instruction's part)``; run before launch on the env's spaces and again where a policy is built."""
    from rlnb.envs.obs import layout_of

    key = "actor.model.vla"
    if head not in HEADS:
        raise ConfigError(f"{key}.head: expected one of {', '.join(HEADS)}, got {head!r}", f"{key}.head")
    layout = layout_of(obs_space)
    if layout is None or not layout.images:
        raise ConfigError(
            f"actor.model.kind: vla reads camera images from dict observations; env.id gives {obs_space}",
            "actor.model.kind",
        )
    images = {p.key: p for p in layout.images}
    names = list(cameras) or list(images)
    unknown = [c for c in names if c not in images]
    if unknown:
        raise ConfigError(
            f"{key}.cameras: expected image parts of the observations ({', '.join(images)}), got {unknown}",
            f"{key}.cameras",
        )
    shapes = {tuple(images[c].shape) for c in names}
    if len(shapes) > 1:
        raise ConfigError(
            f"{key}.cameras: expected images of one size, got {sorted(shapes)}", f"{key}.cameras"
        )
    ((_, _, c),) = shapes
    if c != 3:
        raise ConfigError(
            f"{key}.cameras: the VLA's processor takes RGB images (3 channels), got {c}", f"{key}.cameras"
        )
    texts = [p.key for p in layout.texts]
    if instruction and instruction not in texts:
        raise ConfigError(
            f"{key}.instruction: expected a text part of the observations ({', '.join(texts) or 'none'}), got "
            f"{instruction!r}",
            f"{key}.instruction",
        )
    if not (instruction or texts or default_instruction):
        raise ConfigError(
            f"{key}.instruction: the observations have no text part (an instruction) and no "
            f"{key}.default_instruction is given",
            f"{key}.default_instruction",
        )
    if head == "tokens":
        ActionBins(act_space, len(spec.action_token_ids) if spec is not None else 4096, "env.id")
    elif not isinstance(act_space, gym.spaces.Box) or len(act_space.shape) not in (1, 2):
        raise ConfigError(
            f"{key}.head: the chunk head takes a Box of K x D (or D) continuous actions, got {act_space}",
            f"{key}.head",
        )
    return layout, names, instruction or (texts[0] if texts else "")


def preprocess_images(images: torch.Tensor, spec: VLASpec) -> torch.Tensor:
    """Camera images ``[B, N, H, W, 3]`` uint8 -> the model's pixel values ``[B * N, 3, S, S]`` float32: resized
    with the processor's filter (antialiased, as PIL's), rescaled and normalised as the processor says."""
    b, n, h, w, c = images.shape
    x = images.reshape(b * n, h, w, c).permute(0, 3, 1, 2).float()
    if (h, w) != spec.image_size:
        x = F.interpolate(x, size=spec.image_size, mode=spec.resample, antialias=True, align_corners=False)
        x = x.round_().clamp_(0, 255)  # (PIL resizes 8-bit images to 8 bits)
    mean = torch.tensor(spec.image_mean, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(spec.image_std, device=x.device).view(1, 3, 1, 1)
    return (x * spec.rescale - mean) / std


def _cache_of(output):
    """A forward's KV cache: ``output.cache`` (``transformers`` from 5.24), else ``past_key_values``."""
    return output.cache if "cache" in getattr(output, "__dataclass_fields__", {}) else output.past_key_values


@functools.lru_cache(maxsize=16)
def _takes_token_types(cls: type) -> bool:
    """Whether a VLM's forward names ``token_type_ids`` (PaliGemma's prefix-LM attention), by its signature."""
    import inspect

    try:
        return "token_type_ids" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


class ActionBins:
    """A ``Box`` action space's dimensions cut into ``n`` bins each (OpenVLA's uniform bins over the bounds, -1 to 1
    where a bound is infinite), or a ``Discrete(n)`` space's actions one bin each."""

    def __init__(self, act_space: gym.Space, n: int, key: str = "env.id"):
        if isinstance(act_space, gym.spaces.Discrete):
            if act_space.n > n:
                raise ConfigError(
                    f"{key}: the VLA has {n} action tokens, the action space {act_space} needs {act_space.n}",
                    key,
                )
            self.discrete, self.dims, self.n = True, 1, int(act_space.n)
            return
        if not isinstance(act_space, gym.spaces.Box) or len(act_space.shape) != 1:
            raise ConfigError(
                f"{key}: a VLA's action tokens take Discrete(n) or a 1-D Box of actions, got {act_space}", key
            )
        self.discrete, self.dims, self.n = False, int(act_space.shape[0]), n
        low = np.where(np.isfinite(act_space.low), act_space.low, -1.0)
        high = np.where(np.isfinite(act_space.high), act_space.high, 1.0)
        self.low = torch.as_tensor(low, dtype=torch.float32)
        self.width = torch.as_tensor((high - low) / n, dtype=torch.float32)

    def to_actions(self, bins: torch.Tensor) -> torch.Tensor:  # [B, D] long -> actions as the env takes them
        if self.discrete:
            return bins[:, 0]
        return self.low.to(bins.device) + (bins.float() + 0.5) * self.width.to(bins.device)

    def to_bins(self, actions: torch.Tensor) -> torch.Tensor:  # actions -> [B, D] long
        if self.discrete:
            return actions.long().reshape(-1, 1)
        b = torch.floor((actions.float() - self.low.to(actions.device)) / self.width.to(actions.device))
        return b.clamp_(0, self.n - 1).long()


class VLAPolicy(nn.Module):
    """The actor-critic contract (``act``, ``value``, ``forward(obs, actions)``) over a VLA, for packed dict
    observations with image parts, an instruction (a text part) and optionally vector parts (proprioception).

    Args:
        obs_space: a packed dict observation space (:class:`rlnb.envs.obs.PackedBox`).
        act_space: ``Discrete(n)`` or a 1-D ``Box`` for the ``tokens`` head; a ``Box`` of ``K x D`` (or ``D``,
            ``K = 1``) for the ``chunk`` head.
        path: the VLA's directory (:func:`build_tiny_vla`, or a released one saved with ``save_pretrained``).
        head: ``tokens`` or ``chunk`` (see the module's doc).
        cameras: the image parts read, in order (default: every image part).
        instruction: the text part holding the instruction (default: the first text part); ``""`` with no text
            part: a fixed ``default_instruction``.
        critic_detached: the value head's gradient stops at the VLA's hidden state (``actor.model.vla``'s).
        proprio: ``logits`` or ``token``: how the proprioception reaches the action (see the module's doc).
    """

    def __init__(
        self, obs_space: gym.Space, act_space: gym.Space, path: str, head: str = "tokens",
        cameras: list[str] | tuple[str, ...] = (), instruction: str = "", default_instruction: str = "",
        device: str = "cpu", critic_detached: bool = False, proprio: str = "logits",
    ):  # fmt: skip
        super().__init__()
        if proprio not in PROPRIO:
            raise ConfigError(
                f"actor.model.vla.proprio: expected one of {', '.join(PROPRIO)}, got {proprio!r}",
                "actor.model.vla.proprio",
            )
        self.critic_detached = critic_detached
        key = "actor.model.vla"
        self.vla, processor = load_vla(path, device, f"{key}.path")
        # SigLIP's pooling head, which a VLA reads past (it takes the patches' states): frozen, so that no optimizer,
        # DDP's reduction or DCP's checkpoint waits on weights that no loss reaches
        vision = self.vla.model.vision_tower
        vision = getattr(vision, "vision_model", vision)  # (a SigLIP model, or its transformer)
        if isinstance(getattr(vision, "head", None), nn.Module):
            vision.head.requires_grad_(False)
        self.spec = vla_spec(self.vla.config, processor, f"{key}.path")
        layout, names, self.instruction_key = check_vla(
            obs_space, act_space, self.spec, head, cameras, instruction, default_instruction
        )
        self.layout, self.cameras, self.head_kind = layout, names, head
        self.default_instruction = default_instruction
        self.config = {"kind": "vla", "path": str(path), "head": head, "cameras": names,
                       "instruction": instruction, "default_instruction": default_instruction,
                       "proprio": proprio}  # fmt: skip
        self.processor, self.tok = processor, processor.tokenizer
        hidden = self.vla.config.get_text_config().hidden_size
        self.state_dim = sum(int(np.prod(p.shape)) for p in layout.vectors)
        feat = hidden + self.state_dim
        # OFT's proprio projector (fc, GELU, fc) into the decoder's embedding space: the token at the prompt's end
        self.proprio_proj = (
            nn.Sequential(nn.Linear(self.state_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))
            if proprio == "token" and self.state_dim
            else None
        )
        self.discrete = isinstance(act_space, gym.spaces.Discrete)
        if head == "tokens":
            self.bins = ActionBins(act_space, len(self.spec.action_token_ids), "env.id")
            self.act_shape = () if self.discrete else tuple(act_space.shape)
            self.register_buffer(
                "action_ids", torch.tensor(self.spec.action_token_ids[: self.bins.n]), persistent=False
            )
            # the proprioception's say in each token's logits (OpenVLA reads none; OFT projects it in): 0 at start
            self.state_logits = (
                nn.Linear(self.state_dim, self.bins.dims * self.bins.n)
                if self.state_dim and self.proprio_proj is None
                else None
            )
            if self.state_logits is not None:
                nn.init.zeros_(self.state_logits.weight)
                nn.init.zeros_(self.state_logits.bias)
        else:
            self.act_shape, self.state_logits = tuple(act_space.shape), None
            self.mean_head = nn.Linear(feat, int(np.prod(act_space.shape)))
            nn.init.normal_(self.mean_head.weight, std=0.01)
            nn.init.zeros_(self.mean_head.bias)
            self.log_std = nn.Parameter(torch.full((int(np.prod(act_space.shape)),), -0.5))
        self.value_head = nn.Sequential(nn.Linear(feat, 64), nn.Tanh(), nn.Linear(64, 1))
        self._prompts: dict[str, list[int]] = {}

    def adapt(self, lora=None, gradient_checkpointing: bool = False) -> VLAPolicy:
        """Training levers on the VLA inside (the actor's ``actor.lora``, ``actor.gradient_checkpointing``): LoRA
        adapters on its linear layers through PEFT, only they and the heads training; activation checkpointing
        of its layers. Returns ``self``."""
        if lora is not None and lora.rank > 0:
            from rlnb.components.lm.lora import add_adapters

            self.vla = add_adapters(self.vla, lora)
        if gradient_checkpointing:
            from rlnb.models.lm import enable_checkpointing

            enable_checkpointing(self.vla)
            self.train()  # (transformers checkpoints in training mode only; the tiny VLA's dropouts are 0)
        return self

    def blocks(self) -> list[nn.Module]:
        """What FSDP2 shards one by one (``actor.strategy: fsdp2``): the decoder's layers and the vision tower's
        encoder layers (the rest, embeddings, projector, norms and heads, goes with the policy: this class calls
        the VLA's parts, not its forward)."""
        model = self._base.model
        vision = getattr(getattr(model.vision_tower, "vision_model", model.vision_tower), "encoder", None)
        return list(model.language_model.layers) + (list(vision.layers) if vision is not None else [])

    @property
    def _base(self):
        """The ``transformers`` model, under PEFT's wrapper where LoRA is on."""
        return self.vla.get_base_model() if self.adapted else self.vla

    @property
    def adapted(self) -> bool:
        """Whether LoRA adapters are on the VLA (its state dict then names PEFT's layers)."""
        return hasattr(self.vla, "get_base_model")

    def plain_state(self) -> dict:
        """The state dict a policy without adapters loads: with LoRA, the VLA's weights merged (``W + B A * alpha /
        r``) under its own names; what the rollout and an export get."""
        if not self.adapted:
            return self.state_dict()
        from rlnb.components.lm.lora import merged_state

        return {**{f"vla.{k}": v for k, v in merged_state(self.vla).items()}, **self.head_state()}

    def save_pretrained(self, directory: str | Path) -> Path:
        """The VLA as trained, with its processor and :data:`VLA_FILE`, in ``directory`` (``save_pretrained``'s
        layout: ``AutoModelForImageTextToText.from_pretrained`` loads it); the heads are not in it (they are
        the policy file's)."""
        from rlnb.models.lm import hf_quiet

        directory = Path(directory)
        vla = self.vla
        if self.adapted:  # the adapters merged into a copy: a plain VLA, as from_pretrained reads it
            import copy

            vla = copy.deepcopy(vla).merge_and_unload()
        with hf_quiet():
            vla.save_pretrained(directory)
            self.processor.save_pretrained(directory)
        (directory / VLA_FILE).write_text(json.dumps({"action_token": ACTION_TOKEN,
                                                      "action_bins": len(self.spec.action_token_ids)}))  # fmt: skip
        return directory

    def head_state(self) -> dict:
        """The weights that are not the VLA's own (the action and value heads): what a policy file holds."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("vla.")}

    # -- the prompt ---------------------------------------------------------------------------------------------
    def _prompt_ids(self, instruction: str) -> list[int]:
        ids = self._prompts.get(instruction)
        if ids is None:
            s = self.spec
            text = PROMPT.format(instruction=instruction.strip().lower().rstrip("."))
            ids = [s.image_token_id] * (s.image_seq_length * len(self.cameras))
            ids += [s.bos_token_id] if s.bos_token_id is not None else []
            ids += self.tok(text, add_special_tokens=False)["input_ids"]
            if self.proprio_proj is not None:  # (its embedding is replaced by the projected state: _run)
                ids += [s.pad_token_id]
            if len(self._prompts) < 4096:  # (instructions repeat: a suite has tens)
                self._prompts[instruction] = ids
        return ids

    def _inputs(self, obs: torch.Tensor):
        """Packed observations ``[B, nbytes]`` -> ``(input_ids [B, L], attention_mask [B, L], pixel_values,
        state [B, S])``, prompts left-padded to the longest."""
        parts = self.layout.unpack(obs)
        b = obs.shape[0]
        if self.instruction_key:
            texts = parts[self.instruction_key]
            texts = [t or self.default_instruction for t in (texts if isinstance(texts, list) else [texts])]
        else:
            texts = [self.default_instruction] * b
        rows = [self._prompt_ids(t) for t in texts]
        length = max(map(len, rows))
        ids = torch.full((b, length), self.spec.pad_token_id, dtype=torch.long)
        mask = torch.zeros((b, length), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, length - len(r) :] = torch.tensor(r)
            mask[i, length - len(r) :] = 1
        images = torch.stack([torch.as_tensor(parts[c]) for c in self.cameras], 1)  # [B, N, H, W, 3]
        pixels = preprocess_images(images.to(obs.device), self.spec).to(self.vla.dtype)
        state = [parts[p.key].reshape(b, -1) for p in self.layout.vectors]
        state = torch.cat(state, -1).float() if state else obs.new_zeros((b, 0), dtype=torch.float32)
        return ids.to(obs.device), mask.to(obs.device), pixels, state

    def _run(self, ids, mask, pixels=None, cache=None, use_cache=False, prompt_length=0, state=None):
        """The VLA's trunk (its ``.model``: vision tower, projector and decoder, without the LM head): ``(hidden
        [B, L, H], cache)``; the LM head runs on the positions that need logits only (:meth:`_logits`). A
        PaliGemma attends both ways within its prefix (the image and the prompt: its ``token_type_ids`` 0) and
        causally from the action tokens (1), as it was trained; a decoding step with the cache attends causally to
        all before it, the same attention as the whole sequence's. (Not ``output_hidden_states``: transformers
        then hooks the layers, and a module with those hooks no longer pickles.) With the proprio token, ``state
        [B, S]`` projected is the embedding at the prompt's last position (``prompt_length - 1``)."""
        from rlnb.models.lm import cache_kwarg

        trunk = self._base.model
        extra = cache_kwarg(trunk, cache) if cache is not None else {}
        if cache is None and _takes_token_types(type(trunk)):
            types = torch.ones_like(ids)
            types[:, :prompt_length] = 0
            extra["token_type_ids"] = types
        if state is not None and self.proprio_proj is not None:
            embeds = trunk.get_input_embeddings()(ids)
            p = prompt_length - 1
            token = self.proprio_proj(state).to(embeds.dtype)[:, None]
            extra["inputs_embeds"] = torch.cat([embeds[:, :p], token, embeds[:, p + 1 :]], 1)
        else:
            extra["input_ids"] = ids
        out = trunk(attention_mask=mask, pixel_values=pixels, use_cache=use_cache, **extra)
        return out.last_hidden_state, (_cache_of(out) if use_cache else None)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of ``hidden [..., H]`` (with Gemma 2's final soft-capping where the model has it)."""
        logits = self._base.get_output_embeddings()(hidden)
        cap = getattr(self.vla.config.get_text_config(), "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def _features(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return torch.cat([hidden.float(), state], -1)

    def _value(self, feat: torch.Tensor) -> torch.Tensor:
        return self.value_head(feat.detach() if self.critic_detached else feat).squeeze(-1)

    def _bin_logp(self, logits: torch.Tensor, state: torch.Tensor, dims: slice | int) -> torch.Tensor:
        """The log-softmax over the bins of action dimension(s) ``dims``: ``logits [B, V]`` (one dimension) or
        ``[B, D, V]`` (all), plus the proprioception's part."""
        x = logits.float().index_select(-1, self.action_ids)
        if self.state_logits is not None:
            bias = self.state_logits(state).view(-1, self.bins.dims, self.bins.n)[:, dims]
            x = x + bias
        return torch.log_softmax(x, -1)

    def _normal(self, feat: torch.Tensor) -> torch.distributions.Normal:
        mean = self.mean_head(feat)
        return torch.distributions.Normal(mean, self.log_std.exp().expand_as(mean), validate_args=False)

    # -- the actor-critic contract ------------------------------------------------------------------------------
    def value(self, obs: torch.Tensor) -> torch.Tensor:  # [B, nbytes] -> [B]
        ids, mask, pixels, state = self._inputs(obs)
        hidden = self._run(ids, mask, pixels, prompt_length=ids.shape[1], state=state)[0][:, -1]
        return self._value(self._features(hidden, state))

    def act(self, obs: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False):
        """Sample actions: ``(actions, logprob [B], value [B])``; the ``tokens`` head decodes one token a dimension
        with the KV cache."""
        ids, mask, pixels, state = self._inputs(obs)
        hidden, cache = self._run(
            ids, mask, pixels, use_cache=self.head_kind == "tokens", prompt_length=ids.shape[1], state=state
        )
        feat = self._features(hidden[:, -1], state)
        value = self._value(feat)
        if self.head_kind == "chunk":
            dist = self._normal(feat)
            flat = (
                dist.mean
                if deterministic
                else dist.mean
                + dist.stddev * torch.randn(dist.mean.shape, generator=generator, device=dist.mean.device)
            )
            return flat.reshape(-1, *self.act_shape), dist.log_prob(flat).sum(-1), value
        logits, chosen, logprob = self._logits(hidden[:, -1]), [], 0.0
        for d in range(self.bins.dims):
            logp = self._bin_logp(logits, state, d)  # [B, bins]
            if deterministic:
                k = logp.argmax(-1)
            else:
                k = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            chosen.append(k)
            logprob = logprob + logp.gather(-1, k[:, None]).squeeze(-1)
            if d + 1 < self.bins.dims:
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], 1)
                hidden, cache = self._run(self.action_ids[k][:, None], mask, cache=cache, use_cache=True)
                logits = self._logits(hidden[:, -1])
        actions = self.bins.to_actions(torch.stack(chosen, 1))
        return actions, logprob, value

    def forward(self, obs: torch.Tensor, actions: torch.Tensor):
        """``(logprob [B], entropy [B], value [B])`` of given actions (teacher-forced: the prompt and the action's
        tokens but the last in one forward)."""
        ids, mask, pixels, state = self._inputs(obs)
        length = ids.shape[1]
        if self.head_kind == "tokens":
            bins = self.bins.to_bins(actions)  # [B, D]
            ids = torch.cat([ids, self.action_ids[bins[:, :-1]]], 1)
            mask = torch.cat([mask, mask.new_ones(bins[:, :-1].shape)], 1)
        hidden, _ = self._run(ids, mask, pixels, prompt_length=length, state=state)
        feat = self._features(hidden[:, length - 1], state)
        value = self._value(feat)
        if self.head_kind == "chunk":
            dist = self._normal(feat)
            flat = actions.reshape(actions.shape[0], -1).float()
            return dist.log_prob(flat).sum(-1), dist.entropy().sum(-1), value
        logp = self._bin_logp(self._logits(hidden[:, length - 1 :]), state, slice(None))  # [B, D, bins]
        logprob = logp.gather(-1, bins[..., None]).squeeze(-1).sum(-1)
        entropy = -(logp.exp() * logp).sum(-1).sum(-1)
        return logprob, entropy, value


__all__ = [
    "ActionBins", "VLAPolicy", "VLASpec", "build_tiny_vla", "check_vla", "load_vla", "preprocess_images", "vla_spec",
]  # fmt: skip
