"""Recipes: dataclass schema, YAML + dotted overrides, validation with clear errors."""

from rlnb.config.loader import (
    RecipeError,
    bundled_recipes,
    field_docs,
    load_recipe,
    parse_override,
    recipe_path,
    to_dict,
    to_yaml,
    validate,
)
from rlnb.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    ClusterConfig,
    EnvConfig,
    LoRAConfig,
    ModelConfig,
    Recipe,
    RunnerConfig,
    TinyVLAConfig,
    VLAConfig,
)
from rlnb.config.sections_lm import DataConfig, RewardConfig, RolloutConfig, VLLMConfig

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ClusterConfig",
    "DataConfig",
    "EnvConfig",
    "LoRAConfig",
    "ModelConfig",
    "Recipe",
    "RecipeError",
    "RewardConfig",
    "RolloutConfig",
    "RunnerConfig",
    "TinyVLAConfig",
    "VLAConfig",
    "VLLMConfig",
    "bundled_recipes",
    "field_docs",
    "load_recipe",
    "parse_override",
    "recipe_path",
    "to_dict",
    "to_yaml",
    "validate",
]
