"""Algorithm presets (``algorithm.preset``): the settings a paper's method is, by name, for the LM family.

A preset fills the ``algorithm`` keys it names. Given as an override (``rlnb run grpo_arith
algorithm.preset=dr_grpo``) it replaces what the recipe file says of them; a key set to another value in the same
layer as the preset (both in the file, or both overrides) is refused (each setting has one source); the same value
twice is fine (a run directory's recipe holds the preset and its keys).

Example:
    >>> PRESETS["dr_grpo"]["scale"], PRESETS["dr_grpo"]["agg"]
    ('none', 'seq-mean-token-sum-norm')
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO without its two biases, no division
    # by the group's reward std and no per-sequence length mean (a constant, the longest completion, instead)
    "dr_grpo": {"advantage": "grpo", "policy_loss": "ppo", "scale": "none", "agg": "seq-mean-token-sum-norm"},
    # GSPO (Zheng et al. 2025): the sequence's importance ratio, clipped at the paper's bounds, a mean a sequence
    "gspo": {
        "advantage": "grpo",
        "policy_loss": "gspo",
        "clip_coef": 3e-4,
        "clip_coef_high": 4e-4,
        "agg": "seq-mean-token-mean",
    },
    # CISPO (MiniMax-M1, 2025): clipped, stop-gradient importance weights on every token; no lower bound (as the
    # paper), the upper at 1.28 (Trinity-RFT's default); token-mean over the batch
    "cispo": {
        "advantage": "grpo",
        "policy_loss": "cispo",
        "clip_coef": 1.0,
        "clip_coef_high": 0.28,
        "agg": "token-mean",
    },
}


def apply_preset(tree: dict, errors: list[str], overridden: frozenset[str] = frozenset()) -> None:
    """Fill ``tree["algorithm"]`` (a recipe's raw tree, overrides applied) from its ``preset``, appending an
    error for each key set otherwise in the preset's layer; ``overridden``: the dotted keys the overrides set."""
    algorithm = tree.get("algorithm")
    if not isinstance(algorithm, dict) or algorithm.get("preset", "none") in ("none", None):
        return
    name = algorithm["preset"]
    if not isinstance(name, str) or name not in PRESETS:
        return  # (the schema's Literal names the choices)
    preset_overridden = "algorithm.preset" in overridden
    for key, value in PRESETS[name].items():
        given = algorithm.get(key)
        same = given == value or (isinstance(value, float) and _close(given, value))
        same_layer = (f"algorithm.{key}" in overridden) == preset_overridden
        if key in algorithm and not same and same_layer:
            errors.append(
                f"algorithm.{key}: algorithm.preset {name} sets it to {value!r}, and the recipe to {given!r}; "
                f"drop one (a preset's keys: {', '.join(PRESETS[name])})"
            )
        else:
            algorithm[key] = value


def _close(given, value: float) -> bool:
    try:
        return abs(float(given) - value) <= 1e-12 * max(1.0, abs(value))
    except (TypeError, ValueError):
        return False
