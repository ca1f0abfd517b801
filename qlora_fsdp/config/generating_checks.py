"""Validation of the objectives that generate (grpo, rloo): their prompts, the `generation` section, and each
objective's own section; part of config/validation.py's checks, in one line each."""

from __future__ import annotations

from qlora_fsdp.config.objectives import GrpoConfig, RlooConfig
from qlora_fsdp.config.schema import Config
from qlora_fsdp.errors import ConfigError

REWARDS_HINT = ("[{function: math_answer}] (a built-in: math_answer, format, length_penalty) or "
                "[{function: my_module:my_function}]")


def validate_generating(config: Config) -> None:
    objective, generates = config.train.objective, config.train.kind.generates
    if generates != (config.data.format == "prompt"):
        raise ConfigError("'train.objective: grpo' and 'rloo' read prompts ('data.format: prompt'), and prompts are "
                          f"for them only; got objective {objective} with format {config.data.format}")
    if not generates:
        return
    _validate_generation(config)
    if objective == "grpo":
        _validate_grpo(config.grpo, config)
    else:
        _validate_rloo(config.rloo, config)


def _validate_generation(config: Config) -> None:
    generation = config.generation
    if generation.num_generations < 2:
        raise ConfigError(f"'generation.num_generations' must be at least 2 (a group compares its completions), got "
                          f"{generation.num_generations}")
    if not 0 < generation.max_completion_length < config.data.context_length:
        raise ConfigError(f"'generation.max_completion_length' must be positive and below data.context_length "
                          f"({config.data.context_length}), which also holds the prompt; got "
                          f"{generation.max_completion_length}")
    for key, value in {"generation.temperature": generation.temperature, "generation.top_p": generation.top_p}.items():
        if value <= 0:
            raise ConfigError(f"'{key}' must be positive, got {value}")
    if generation.rows is not None and generation.rows < 1:
        raise ConfigError(f"'generation.rows' must be at least 1 or null, got {generation.rows}")
    if generation.top_k < 0:
        raise ConfigError(f"'generation.top_k' must be 0 (off) or more, got {generation.top_k}")


def _positive(section: str, values: dict[str, float]) -> None:
    for key, value in values.items():
        if value <= 0:
            raise ConfigError(f"'{section}.{key}' must be positive, got {value}")


def _reference_free_start(section: str, beta: float, config: Config) -> None:
    """The KL term's reference is the base (the adapter off) or the starting adapter kept frozen; a run that
    trains routers changes the base itself."""
    if beta > 0 and config.lora.train_router:
        raise ConfigError(f"'{section}.beta' > 0 compares against the base with the adapter off, which a run that "
                          f"trains routers does not have; set {section}.beta: 0")


def _validate_grpo(grpo: GrpoConfig, config: Config) -> None:
    environment_rewards = bool(grpo.environment or grpo.environments)  # get_reward(), checked when it is found
    if (not grpo.rewards and not environment_rewards) or not all(reward.function for reward in grpo.rewards):
        raise ConfigError(f"'train.objective: grpo' needs reward functions: grpo.rewards: {REWARDS_HINT}")
    _positive("grpo", {"epsilon": grpo.epsilon, "num_iterations": grpo.num_iterations,
                       "epsilon_high": grpo.resolved_epsilon_high})
    if grpo.environment and grpo.environments:
        raise ConfigError("'grpo.environment' names one environment for every record, 'grpo.environments' several "
                          "chosen by each record's `environment` column: set one of them")
    if (grpo.max_tool_calling_iterations or 0) < 0 or grpo.tool_timeout_s <= 0:
        raise ConfigError("'grpo.max_tool_calling_iterations' must be 0 or more (or null: no limit) and "
                          f"'grpo.tool_timeout_s' positive; got {grpo.max_tool_calling_iterations}, "
                          f"{grpo.tool_timeout_s}")
    if grpo.beta < 0 or (grpo.delta is not None and grpo.delta <= 1):
        raise ConfigError(f"'grpo.beta' must be 0 or more, 'grpo.delta' null or above 1; got {grpo.beta}, "
                          f"{grpo.delta}")
    _reference_free_start("grpo", grpo.beta, config)


def _validate_rloo(rloo: RlooConfig, config: Config) -> None:
    if not rloo.rewards or not all(reward.function for reward in rloo.rewards):
        raise ConfigError(f"'train.objective: rloo' needs reward functions: rloo.rewards: {REWARDS_HINT}")
    _positive("rloo", {"epsilon": rloo.epsilon, "num_iterations": rloo.num_iterations,
                       "epsilon_high": rloo.resolved_epsilon_high})
    if rloo.beta < 0:
        raise ConfigError(f"'rloo.beta' must be 0 or more, got {rloo.beta}")
    clip = rloo.reward_clip_range
    if clip is not None and (len(clip) != 2 or clip[0] >= clip[1]):
        raise ConfigError(f"'rloo.reward_clip_range' must be [low, high] with low below high, or null; got {clip}")
    _reference_free_start("rloo", rloo.beta, config)
    if config.grpo.calls_tools:
        raise ConfigError("'grpo.tools' and environments are GRPO's multi-turn rollouts; train.objective rloo "
                          "generates single replies (as TRL's RLOOTrainer): remove them or use train.objective grpo")
