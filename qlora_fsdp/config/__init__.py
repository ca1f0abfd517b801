"""Recipe configuration: the schema (`schema.py`) and its loader (`loader.py`)."""

from qlora_fsdp.config.generation import GenerationConfig, GenerationLayout
from qlora_fsdp.config.loader import (
    RUN_CONTROL_KEYS,
    changed_settings,
    last_override,
    load_config,
    merged_overrides,
    resolve_recipe_path,
    to_dict,
    to_yaml,
)
from qlora_fsdp.config.objectives import (
    OBJECTIVES,
    DpoLossType,
    GrpoConfig,
    GrpoLossType,
    ObjectiveKind,
    ObjectiveName,
    PreferenceConfig,
    RewardConfig,
    RlooConfig,
)
from qlora_fsdp.config.schema import (
    FSDP_CONFIGS_DIR,
    RECIPES_DIR,
    REPO_ROOT,
    ActivationCheckpointingConfig,
    CheckpointedLayers,
    CheckpointScope,
    Config,
    DataConfig,
    DataFormat,
    DType,
    DTypeChoice,
    ExportConfig,
    ExportTarget,
    FSDPConfig,
    HardwareConfig,
    LoggingConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    OverlongPolicy,
    ProfileConfig,
    QuantConfig,
    SourceConfig,
    Template,
    TemplateChoice,
    TrainConfig,
)
from qlora_fsdp.config.validation import validate

__all__ = [
    "ActivationCheckpointingConfig", "CheckpointScope", "CheckpointedLayers", "Config", "DType", "DTypeChoice",
    "DataConfig", "DataFormat", "DpoLossType", "ExportConfig", "ExportTarget", "FSDPConfig", "FSDP_CONFIGS_DIR",
    "GenerationConfig", "GenerationLayout", "GrpoConfig", "GrpoLossType",
    "HardwareConfig", "LoggingConfig", "LoraConfig", "LossConfig", "ModelConfig", "OBJECTIVES", "ObjectiveName",
    "ObjectiveKind", "OptimConfig", "OverlongPolicy", "PreferenceConfig", "ProfileConfig",
    "QuantConfig", "RECIPES_DIR", "REPO_ROOT", "RUN_CONTROL_KEYS", "RewardConfig", "RlooConfig",
    "SourceConfig", "Template", "TemplateChoice", "TrainConfig", "changed_settings", "last_override",
    "load_config", "merged_overrides",
    "resolve_recipe_path", "to_dict", "to_yaml", "validate",
]
