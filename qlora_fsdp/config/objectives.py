"""The recipe's objective sections: which objective trains, and the settings of the preference objectives (DPO,
ORPO, SimPO, KTO, reward models) and of GRPO with its reward functions. Part of the schema (schema.py re-exports)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

ObjectiveName = Literal["sft", "dft", "dpo", "orpo", "simpo", "kto", "reward", "grpo", "rloo"]
DataKind = Literal["samples", "pairs", "prompts"]


@dataclass(frozen=True)
class ObjectiveKind:
    """What validation and the data need to know of a training objective before its class is imported (its class:
    qlora_fsdp/objectives/table.py, which has a row for each of these); no other module compares objective names."""

    # what it reads: samples (SFT; with images where the records show some), pairs (a chosen and a rejected
    # sequence side by side in a row; KTO's unpaired records as pairs of their own and their KL sequence), prompts
    data: DataKind
    reference: bool = False  # compared against the base with the adapter off (or that computed before training)
    default_beta: float | None = None  # preference.beta when the recipe leaves it null
    unpaired: bool = False  # KTO: one completion and a label a record
    reward_head: bool = False  # a scalar head beside the language model (a reward model)
    generates: bool = False  # the policy generates its completions (generation's memory and time are planned)
    # data.overlong may split a sample, and data.train_on_inputs may train on prompts (SFT's alone)
    whole_samples: bool = True

    @property
    def pairs(self) -> bool:
        """Two sequences of a pair share a row (several samples a row, as packing puts them)."""
        return self.data == "pairs"


# train.objective to its kind (and objectives/table.py to its class)
OBJECTIVES: dict[str, ObjectiveKind] = {
    "sft": ObjectiveKind("samples", whole_samples=False),
    "dft": ObjectiveKind("samples", whole_samples=False),
    "dpo": ObjectiveKind("pairs", reference=True, default_beta=0.1),
    "orpo": ObjectiveKind("pairs"),
    "simpo": ObjectiveKind("pairs", default_beta=2.0),
    "kto": ObjectiveKind("pairs", reference=True, default_beta=0.1, unpaired=True),
    "reward": ObjectiveKind("pairs", reward_head=True),
    "grpo": ObjectiveKind("prompts", generates=True),
    "rloo": ObjectiveKind("prompts", generates=True),
}
# the sections objectives keep their own settings in (each objective's SECTIONS names its own): a recipe of another
# objective leaves them unread
OBJECTIVE_SECTIONS = ("preference", "generation", "grpo", "rloo")


DpoLossType = Literal["sigmoid", "robust", "hinge", "ipo"]


@dataclass
class PreferenceConfig:
    """Preference tuning (train.objective dpo, orpo, simpo; reward: a reward model) on pairs of a prompt, a chosen
    and a rejected completion (qlora_fsdp/data/pair_records.py reads them; qlora_fsdp/losses/pair_formulas.py has the
    formulas); kto on unpaired records of a prompt, a completion and a desirable/undesirable label
    (qlora_fsdp/data/kto_records.py)."""

    beta: float | None = None  # None: the objective's usual value (dpo and kto 0.1, simpo 2.0)
    loss_type: DpoLossType = "sigmoid"  # dpo: sigmoid (the paper's), robust (label noise), hinge (SLiC), ipo
    label_smoothing: float = 0.0  # dpo sigmoid and robust, simpo: the share of pairs taken as mislabelled
    gamma: float = 1.0  # simpo: the target margin between the rewards (the SimPO paper's gamma/beta of 0.5)
    odds_ratio_weight: float = 0.1  # orpo: lambda, the weight of the odds-ratio term beside the chosen NLL
    bad_pairs: Literal["error", "drop"] = "error"  # an empty or identical completion, prompts that disagree
    # reward: the Bradley-Terry loss plus this times the mean squared sum of a pair's two rewards, which keeps the
    # rewards centred on 0 (TRL's center_rewards_coefficient; it suggests 0.01); None: off. A pair's own margin
    # (a `margin` field in its record) is subtracted from its reward gap, as TRL does
    center_rewards_coefficient: float | None = None
    desirable_weight: float = 1.0  # kto: the weight of a desirable record's loss (TRL's desirable_weight)
    undesirable_weight: float = 1.0  # kto: and of an undesirable one's
    # dpo, kto: adapter_off runs the base with the adapter off on every micro-batch (one more forward a step);
    # precomputed runs it once per pair before training and keeps the result with the run; auto: precomputed when
    # the run sees every pair at least once (then it is never dearer), else adapter_off (docs/benchmarks/preference.md)
    reference: Literal["auto", "adapter_off", "precomputed"] = "auto"

    def resolved_beta(self, objective: ObjectiveName) -> float:
        if self.beta is not None:
            return self.beta
        return OBJECTIVES[objective].default_beta or 0.1


@dataclass
class RewardConfig:
    """One reward function: a built-in's name (qlora_fsdp/rewards/builtin.py) or `module:function`, importable
    where training runs; called as TRL calls one (prompts=, completions=, completion_ids=, and every other column
    of the dataset as a keyword argument), returning a float or None per completion."""

    function: str = ""  # required: e.g. math_answer, or my_rewards:correctness
    weight: float = 1.0  # its share of the reward: the weighted sum over the functions (None scores left out)
    options: dict[str, Any] = field(default_factory=dict)  # a built-in's settings, e.g. {tags: [think, answer]}


GrpoLossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]


@dataclass
class GrpoConfig:
    """train.objective grpo: the policy generates `generation.num_generations` completions per prompt (the
    `generation` section), rewards score them, and the update follows TRL 1.16's GRPOTrainer
    (qlora_fsdp/losses/policy.py has the formulas; the defaults are TRL's)."""

    rewards: list[RewardConfig] = field(default_factory=list)  # one at least; their weighted sum is the reward
    scale_rewards: Literal["group", "batch", "none"] = "group"  # the standard deviation advantages divide by
    # how the step's token losses are averaged: dapo, bnpo over every token; grpo per completion, then over them;
    # dr_grpo over completions x max_completion_length (TRL's default: dapo)
    loss_type: GrpoLossType = "dapo"
    importance_sampling_level: Literal["token", "sequence"] = "token"  # sequence: GSPO
    epsilon: float = 0.2  # the ratio's clip below 1
    epsilon_high: float | None = None  # and above 1; None: epsilon (DAPO's clip-higher uses 0.28)
    delta: float | None = None  # an upper cap on the unclipped ratio (two-sided clipping); None: none
    beta: float = 0.0  # the KL penalty's weight; reference: the base, or a continued adapter frozen; 0: none
    num_iterations: int = 1  # updates per generated batch; above 1 the log-probabilities at generation are kept
    mask_truncated_completions: bool = False  # completions cut at max_completion_length count in no loss
    # multi-turn rollouts (docs/grpo.md, "Tools and environments"): the model's calls are run, their results appended
    # as tool messages (context, never trained on), and it goes on until a reply without a call
    tools: list[str] = field(default_factory=list)  # module:function or path/file.py:function, typed and documented
    environment: str = ""  # module:factory: an environment per rollout, its public methods the tools (TRL's)
    environments: dict[str, str] = field(default_factory=dict)  # several by name; each record's `environment` picks
    max_tool_calling_iterations: int | None = None  # TRL's: rounds of calls a rollout may take; None: no limit
    tool_timeout_s: float = 30.0  # a call that runs longer fails (its message says so); the rollout goes on

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools or self.environment or self.environments)

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class RlooConfig:
    """train.objective rloo: REINFORCE Leave-One-Out as TRL 1.16's RLOOTrainer (qlora_fsdp/objectives/rloo.py has
    the formulas): each completion's advantage is its reward less the mean of its group's other rewards, the KL to
    the reference a penalty on the reward, and the update a clipped ratio of whole-sequence probabilities. The
    completions are the `generation` section's; the defaults are TRL's."""

    rewards: list[RewardConfig] = field(default_factory=list)  # one at least; their weighted sum is the reward
    beta: float = 0.05  # the KL penalty's weight: beta times the completion's summed log-ratio to the reference
    epsilon: float = 0.2  # the sequence ratio's clip below 1
    epsilon_high: float | None = None  # and above 1; None: epsilon
    num_iterations: int = 1  # updates per generated batch; above 1 the log-probabilities at generation are kept
    normalize_advantages: bool = False  # advantages less their mean over the step, over their std (+1e-4)
    reward_clip_range: list[float] | None = None  # [low, high]: each reward clamped before the baseline
    mask_truncated_completions: bool = False  # completions cut at max_completion_length count in no loss

    @property
    def calls_tools(self) -> bool:
        return False  # TRL's RLOO has no multi-turn rollouts

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
