"""Recipe configuration: the schema (`schema.py`) and its loader (`loader.py`)."""

from qlora_fsdp.config.loader import (
    RUN_CONTROL_KEYS,
    changed_settings,
    load_config,
    resolve_recipe_path,
    to_dict,
    to_yaml,
)
from qlora_fsdp.config.schema import (
    FSDP_CONFIGS_DIR,
    PAIR_OBJECTIVES,
    RECIPES_DIR,
    REPO_ROOT,
    ActivationCheckpointingConfig,
    CheckpointedLayers,
    CheckpointScope,
    Config,
    DataConfig,
    DataFormat,
    DpoLossType,
    DType,
    DTypeChoice,
    FSDPConfig,
    GrpoConfig,
    GrpoLossType,
    HardwareConfig,
    LoggingConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    Objective,
    OptimConfig,
    OverlongPolicy,
    PreferenceConfig,
    ProfileConfig,
    QuantConfig,
    RewardConfig,
    SourceConfig,
    Template,
    TemplateChoice,
    TrainConfig,
)
from qlora_fsdp.config.validation import validate

__all__ = [
    "ActivationCheckpointingConfig", "CheckpointScope", "CheckpointedLayers", "Config", "DType", "DTypeChoice",
    "DataConfig", "DataFormat", "DpoLossType", "FSDPConfig", "FSDP_CONFIGS_DIR", "GrpoConfig", "GrpoLossType",
    "HardwareConfig", "LoggingConfig", "LoraConfig", "LossConfig", "ModelConfig", "Objective", "OptimConfig",
    "OverlongPolicy", "PAIR_OBJECTIVES", "PreferenceConfig", "ProfileConfig", "QuantConfig", "RECIPES_DIR", "REPO_ROOT",
    "RUN_CONTROL_KEYS", "RewardConfig", "SourceConfig", "Template", "TemplateChoice", "TrainConfig",
    "changed_settings", "load_config", "resolve_recipe_path", "to_dict", "to_yaml", "validate",
]
