"""GRPO's optimizer step on one rank: generate, score, and update (qlora_fsdp/losses/policy.py has the loss).

A step takes the rank's prompts of the step (micro_batch_size a micro-batch, grad_accum_steps micro-batches),
generates num_generations completions of each in one call, scores them, and turns the rewards into advantages
(groups never cross ranks: a prompt's completions are all made where the prompt is). Each micro-batch's completions
are packed into rows (or padded) and their share of the loss backpropagated; gradients reduce-scatter once, after
the last. The loss is normalized by counts summed over every micro-batch and rank: any split, one big batch's.

Under context parallel (fsdp.context_parallel) the ranks sharing rows take the same prompts: each generates the
group's completions (generation's weights are gathered by every rank alike) and the first's completions and scores
are kept by all; the update splits each micro-batch's rows over them, a completion's whole-sequence terms (its
token mean, GSPO's ratio) summed across the split.

With num_iterations > 1, one generation serves that many optimizer steps, and the log-probabilities at generation
are kept (the ratio's denominator); with beta > 0 the reference's (the adapter off) are computed at generation too.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, cast

import torch
from torch import nn

from qlora_fsdp.agents.environments import reward_functions
from qlora_fsdp.agents.recipe import rollout_tools
from qlora_fsdp.config import Config, GrpoConfig, RlooConfig, Template
from qlora_fsdp.data.batching import Batch, Sample, collate, collate_packed, pack
from qlora_fsdp.data.kinds import TrainingData
from qlora_fsdp.data.prompts import Prompts
from qlora_fsdp.distributed import all_reduce_sums
from qlora_fsdp.distributed.grad_sync import set_gradient_sync
from qlora_fsdp.distributed.row_groups import RowSplit
from qlora_fsdp.distributed.split_sums import from_first_part, gathered_over_split
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.generation.plan import GenerationPlan
from qlora_fsdp.labels import IGNORE_INDEX
from qlora_fsdp.layers.split_rows import model_trade
from qlora_fsdp.losses.forward import ForwardLoss, PolicyTokens, counted_once
from qlora_fsdp.losses.pair_losses import adapter_off
from qlora_fsdp.losses.policy import (
    StepCounts,
    TokenTerms,
    clip_fractions,
    group_advantages,
    kl_sum,
    std_from_sums,
    step_share,
)
from qlora_fsdp.losses.router import grpo_router_coefficient
from qlora_fsdp.objectives.base import Objective, RunParts, StepResult, full_length_batches
from qlora_fsdp.objectives.grpo_records import (
    Generation,
    completion_sample,
    held_out_share,
    loaded_generation,
    reward_metrics,
    reward_rollouts,
    sample_record,
    saved_generation,
)
from qlora_fsdp.objectives.reference_adapter import adapter_weights, frozen_adapter
from qlora_fsdp.objectives.reward_model_scores import reward_model_function
from qlora_fsdp.objectives.rollouts import decoding
from qlora_fsdp.objectives.row_shards import one_row_per_sample, row_part
from qlora_fsdp.objectives.turns import Made, ToolRollouts
from qlora_fsdp.rewards.functions import Reward, combined, resolve_rewards, score


class Grpo(Objective):
    """GRPO (train.objective grpo): the policy generates its completions from the sampler's prompts."""

    PROGRESS_METRICS: ClassVar[tuple[str, ...]] = ("reward", "kl")
    EVAL_METRICS: ClassVar[tuple[str, ...]] = ("eval_reward",)
    SECTION: ClassVar[str] = "grpo"  # the recipe section of the objective's own settings
    SECTIONS: ClassVar[tuple[str, ...]] = ("generation", "grpo")
    CLIPPED_PER: ClassVar[str] = "tokens"  # what the clip ratios count (RLOO's ratio is a completion's)

    def __init__(self, cfg: Config, forward_loss: ForwardLoss, rewards: list[Reward] | None = None) -> None:
        super().__init__(cfg, forward_loss)
        self.grpo, self.generation = cfg.grpo, cfg.generation
        self.settings = self.section_of(cfg)  # what GRPO shares with RLOO: rewards, beta, clip, iterations
        self.rewards = rewards or []  # given (tests), or the recipe's, found when a run attaches
        self.given_rewards = rewards is not None
        self.current: Generation | None = None
        self.current_sample: dict[str, Any] | None = None
        self.uses = 0  # optimizer steps the current generation has served

    @classmethod
    def section_of(cls, cfg: Config) -> GrpoConfig | RlooConfig:
        return cfg.grpo

    @classmethod
    def check_before_loading(cls, cfg: Config) -> None:
        """Unknown reward functions, tools or environments, a tool without type hints: one line, before loading."""
        settings = cls.section_of(cfg)
        if settings.calls_tools:
            tooling = rollout_tools(cfg.grpo)
            if not cfg.grpo.rewards and not reward_functions(tooling.environments):
                raise ConfigError("GRPO needs a reward: grpo.rewards, or an environment with a get_reward() method")
        if settings.rewards:
            resolve_rewards(settings.rewards, cfg.generation, cls.SECTION, {"reward_model": reward_model_function})

    def attach(self, run: RunParts) -> None:
        super().attach(run)
        assert run.tokenizer is not None, "GRPO decodes its completions"
        self.info, self.model, self.tokenizer = run.info, run.model, run.tokenizer
        tokenizer = run.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.router_coefficient = grpo_router_coefficient(run.model)
        if not self.given_rewards:
            self.rewards = (resolve_rewards(self.settings.rewards, self.generation, self.SECTION,
                                            {"reward_model": reward_model_function}) if self.settings.rewards else [])
        # starting from an adapter, the KL term's reference is that adapter, frozen (TRL's); else the adapter off
        self.reference = frozen_adapter(run.model) if self.keeps_reference_adapter() else None
        self.tool_rollouts: ToolRollouts | None = None
        if self.settings.calls_tools:
            config = getattr(run.model.config, "text_config", run.model.config)
            positions = getattr(config, "max_position_embeddings", None) or 1 << 30
            self.tool_rollouts = ToolRollouts(self.grpo, tokenizer, cast(Template, self.data.template), positions,
                                              self.cfg.prompt_room, self.generation.max_completion_length,
                                              run.info.device)
            self.rewards += [Reward(name, function, 1.0)
                             for name, function in reward_functions(self.tool_rollouts.tooling.environments)]

    @property
    def cache_tokens(self) -> int:
        """A row's longest prompt and completion: one KV cache length for every generation call of the run."""
        return self.cfg.prompt_room + self.generation.max_completion_length

    @property
    def data(self) -> TrainingData[Prompts]:
        return self.parts.data

    # ---- the batches ------------------------------------------------------------------------------------------

    @property
    def split(self) -> RowSplit:
        return self.parts.split

    def batch(self, samples: list[Sample]) -> tuple[Batch, list[int]]:
        """The micro-batch as the model takes it (under context parallel, this rank's part of its rows), and the
        order its samples are numbered in (row by row)."""
        if not self.cfg.data.packing:
            whole = one_row_per_sample(samples, self.pad_id) if self.split.splits else collate(samples, self.pad_id)
            return row_part(whole, self.split, self.pad_id), list(range(len(samples)))
        rows = pack([len(s.input_ids) for s in samples], self.cfg.data.context_length)
        order = [index for row in rows for index in row]
        whole = collate_packed([[samples[i] for i in row] for row in rows], self.pad_id)
        return row_part(whole, self.split, self.pad_id), order

    def logps_by_completion(self, generation_samples: list[Sample], indices: list[int],
                            adapter: bool) -> list[torch.Tensor]:
        """Each completion's target log-probabilities (no gradients), under the policy or the reference."""
        batch, order = self.batch([generation_samples[i] for i in indices])
        with torch.no_grad(), (nullcontext() if adapter else self.reference_model()):
            flat = self.forward_loss.token_logps(self.model, batch, self.info.device, self.generation.temperature).logps
        if self.split.group is not None:  # the parts' targets, in the row's order
            flat = gathered_over_split(flat, self.split.group)
        pieces = torch.split(flat.detach(), batch.targets_per_sample().tolist())
        by_position = dict(zip(order, pieces, strict=True))
        return [by_position[i] for i in range(len(indices))]

    def reference_model(self) -> AbstractContextManager[Any]:
        """The KL term's reference: the adapter the run started from, frozen, or the adapter off."""
        return adapter_weights(self.model, self.reference) if self.reference is not None else adapter_off(self.model)

    # ---- generation and rewards -------------------------------------------------------------------------------

    def make(self, prompts: Prompts) -> Made:
        """The step's completions of `prompts`: single replies, or multi-turn rollouts with the recipe's tools,
        the weights placed for generating once for all their turns."""
        g = self.generation.num_generations
        with decoding(self.model, self.tokenizer, self.planned_generation(), self.info.device, self.info.world_size,
                      len(prompts) * g, max(len(ids) for ids in prompts.ids), cache_tokens=self.cache_tokens) as decode:
            if self.tool_rollouts is not None:
                return self.tool_rollouts.make(decode, prompts, g)
            rows = [ids for ids in prompts.ids for _ in range(g)]
            made = decode(rows, images=self.row_images(prompts))
        return Made(rows, made.ids, made.truncated)

    def row_images(self, prompts: Prompts) -> list[dict[str, torch.Tensor] | None] | None:
        """Each completion's prompt images (num_generations rows a prompt), or None for text prompts."""
        if prompts.vision is None:
            return None
        return [prompts.images_of(p) for p in range(len(prompts)) for _ in range(self.generation.num_generations)]

    def advantages(self, rewards: torch.Tensor, old: list[torch.Tensor] | None,
                   ref: list[torch.Tensor] | None) -> torch.Tensor:
        """Each completion's advantage from the rewards (`old`, `ref`: each completion's kept log-probabilities at
        generation, the policy's and the reference's, where the update keeps them)."""
        scale = self.grpo.scale_rewards
        batch_std = None
        if scale == "batch":  # over every rank's completions of the step
            present = rewards[~torch.isnan(rewards)].double() * self.counts_once  # a split's first rank counts
            sums = all_reduce_sums([present.numel() * self.counts_once, present.sum().item(),
                                    (present**2).sum().item()], self.info.device)
            batch_std = std_from_sums(*sums)
        return group_advantages(rewards, self.generation.num_generations, scale, batch_std)

    def generate(self, units: list[list[int]]) -> Generation:
        g = self.generation.num_generations
        flat_units = [u for micro in units for u in micro]
        prompts = self.data.train.subset(flat_units)
        started = time.perf_counter()
        made = self.make(prompts)
        seconds = time.perf_counter() - started
        scores = score(self.rewards, reward_rollouts(self.tokenizer, prompts, made, g)) if self.counts_once else None
        if self.split.group is not None:  # the split's ranks update on the same completions: its first rank's
            made, scores = from_first_part((made, scores), self.split.group)
        assert scores is not None, "the first rank of a split scores its completions"
        mask = self.settings.mask_truncated_completions
        policy: list[list[int] | None] = list(made.policy) if made.policy else [None] * len(made.ids)
        images = self.row_images(prompts) or [None] * len(made.ids)
        samples = [completion_sample(prompt, ids, mask and cut, kept, vision) for prompt, ids, cut, kept, vision
                   in zip(made.prompts, made.ids, made.truncated, policy, images, strict=True)]
        rewards = combined(scores, [r.weight for r in self.rewards])
        micro_batches, start = [], 0
        for micro in units:
            micro_batches.append(list(range(start, start + len(micro) * g)))
            start += len(micro) * g
        old = ref = None
        if self.keeps_old_logps():
            old = [lp for m in micro_batches for lp in self.logps_by_completion(samples, m, adapter=True)]
        if self.keeps_reference_logps():
            ref = [lp for m in micro_batches for lp in self.logps_by_completion(samples, m, adapter=False)]
        tokens = sum(sum(label != IGNORE_INDEX for label in s.labels) for s in samples)
        completions, n_tokens = all_reduce_sums([len(samples) * self.counts_once, tokens * self.counts_once],
                                                self.info.device)
        names = [reward.name for reward in self.rewards]
        metrics = reward_metrics(names, scores, rewards, made, seconds, self.info, self.counts_once)
        return Generation(samples, micro_batches, self.advantages(rewards, old, ref), old, ref,
                          StepCounts(completions, n_tokens, len(micro_batches) * self.split.data_ranks), metrics,
                          sample_record(self.tokenizer, prompts, made, rewards, g))

    @property
    def counts_once(self) -> int:
        """1 where this rank counts the step's completions: every rank, or a split's first (its ranks share them)."""
        return int(self.split.index == 0)

    def has_eval(self) -> bool:
        return len(self.data.eval) > 0

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out prompts' rewards: each rank generates for an equal share of them (a collective: every rank
        steps as often; a rank short of prompts repeats one, left out of the sums), num_generations completions
        each, sampled as in training from a generator seeded by the step, so evaluating leaves training's sampling
        where it was (a resumed run samples the same)."""
        indices, own = held_out_share(len(self.data.eval), self.info.rank, self.info.world_size)
        prompts = self.data.eval.subset(indices)
        devices = [self.info.device] if self.info.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.cfg.train.seed + 7919 * step + self.info.rank)
            made = self.make(prompts)
        g = self.generation.num_generations
        scores = score(self.rewards, reward_rollouts(self.tokenizer, prompts, made, g))
        metrics = reward_metrics([r.name for r in self.rewards], scores,
                                 combined(scores, [r.weight for r in self.rewards]), made, 0.0, self.info, rows=own * g)
        kept = ["reward", "reward_std", "completion_length", "truncated_ratio"]
        kept += [f"rewards/{r.name}" for r in self.rewards]
        return {f"eval_{key}": metrics[key] for key in kept}

    # ---- the update -------------------------------------------------------------------------------------------

    def next_generation(self) -> Generation:
        if self.current is None or self.uses >= self.settings.num_iterations:
            sampler = self.parts.sampler
            assert sampler is not None, "a training run's objective draws from the loop's sampler"
            self.current, self.uses = self.generate(sampler.next_step()), 0
            self.current_sample = self.current.sample
        self.uses += 1
        return self.current

    def micro_batch_share(self, generation: Generation,
                          indices: list[int]) -> tuple[torch.Tensor, TokenTerms, PolicyTokens]:
        """The micro-batch's share of the step's loss (with a mixture of experts' load-balancing loss where TRL
        adds it: the coefficient times the mean over every micro-batch and rank), its token terms and forward."""
        batch, order = self.batch([generation.samples[i] for i in indices])
        picked = [indices[i] for i in order]
        device = self.info.device
        forward = self.forward_loss.token_logps(self.model, batch, device, self.generation.temperature,
                                                router_aux=self.router_coefficient is not None)
        logps = forward.logps

        here = slice(batch.targets_before(), batch.targets_before() + logps.numel())  # a split row's part

        def flat(per_completion: list[torch.Tensor] | None) -> torch.Tensor | None:
            return None if per_completion is None else torch.cat([per_completion[i] for i in picked])[here].to(device)

        terms = TokenTerms(logps, flat(generation.old_logps), flat(generation.ref_logps),
                           generation.advantages[picked].to(device), batch.target_samples().to(device),
                           batch.numbered_samples(), self.split.group, batch.counts_once())
        share = self.update_share(terms, generation.counts)
        if forward.router_aux is not None and self.router_coefficient is not None:
            micro_batches = len(generation.micro_batches) * self.split.data_ranks
            share = share + counted_once(self.router_coefficient * forward.router_aux / micro_batches, batch)
        return share, terms, forward

    def update_share(self, terms: TokenTerms, counts: StepCounts) -> torch.Tensor:
        """The micro-batch's share of the step's loss: TRL's GRPO loss (losses/policy.py)."""
        return step_share(terms, self.grpo, counts, self.generation.max_completion_length)

    def clipped(self, terms: TokenTerms) -> tuple[float, float]:
        return clip_fractions(terms, self.grpo)

    def kl_of(self, terms: TokenTerms) -> float:  # the micro-batch's, summed over tokens (`kl` logs its mean)
        return kl_sum(terms)

    def step(self, loss_factor: float = 1.0) -> StepResult:
        """One optimizer step's gradients (generating first where the last generation is used up)."""
        generation = self.next_generation()
        local, low, high, kl, entropy, aux, n_tokens = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0
        for index, indices in enumerate(generation.micro_batches):
            set_gradient_sync(self.model, index == len(generation.micro_batches) - 1)
            share, terms, forward = self.micro_batch_share(generation, indices)
            entropy += float(forward.entropies.sum())
            aux += float(forward.router_aux) if forward.router_aux is not None else 0.0
            (share * loss_factor if loss_factor != 1.0 else share).backward()
            local += share.item()
            clipped = self.clipped(terms)
            low, high, kl = low + clipped[0], high + clipped[1], kl + self.kl_of(terms)
            n_tokens += sum(len(generation.samples[i].input_ids) for i in indices) * self.counts_once
        loss, low, high, kl, entropy, aux, tokens = all_reduce_sums(
            [local, low, high, kl, entropy, aux, n_tokens], self.info.device)
        counts = generation.counts
        clip_unit = counts.tokens if self.CLIPPED_PER == "tokens" else counts.completions
        metrics = {**generation.metrics, "clip_ratio_low": low / max(clip_unit, 1.0),
                   "clip_ratio_high": high / max(clip_unit, 1.0), "entropy": entropy / max(counts.tokens, 1.0)}
        if self.settings.beta != 0.0:
            metrics["kl"] = kl / max(counts.tokens, 1.0)
        if self.router_coefficient is not None:  # every rank of a split holds its rows' whole
            metrics["router_aux_loss"] = aux / (len(generation.micro_batches) * self.info.world_size)
        return StepResult(loss, counts.tokens, tokens, counts.completions, tokens, metrics)

    def state(self) -> dict[str, Any]:
        """The generation still in use (num_iterations > 1), for a checkpoint: a resumed run updates on the very
        completions the uninterrupted one does."""
        if self.current is None or self.uses >= self.settings.num_iterations:
            return {"uses": 0}
        return {"uses": self.uses, **saved_generation(self.current)}

    def load_state(self, state: dict[str, Any] | None) -> None:
        if not state or not state["uses"]:
            return
        self.current, self.uses = loaded_generation(state), state["uses"]

    def take_sample(self) -> dict[str, Any] | None:
        """The current generation's completions record, once (rank 0 writes it)."""
        sample, self.current_sample = self.current_sample, None
        return sample

    # ---- a plan ------------------------------------------------------------------------------------------------

    def planned_rows(self) -> int:
        """A micro-batch's forward holds num_generations completions of each of its prompts, each up to the whole
        context (packing puts shorter ones together; the plan takes the longest)."""
        return self.cfg.data.micro_batch * self.generation.num_generations

    def planned_generation(self) -> GenerationPlan:
        """The step's prompts, num_generations completions each; one generation serves num_iterations steps; with
        tools, up to max_tool_calling_iterations rounds of tool results (1 where it sets none)."""
        prompts = self.cfg.data.micro_batch * self.cfg.data.grad_accum_steps
        kept = self.keeps_old_logps() + self.keeps_reference_logps()
        limit = self.grpo.max_tool_calling_iterations
        rounds = (1 if limit is None else limit) if self.settings.calls_tools else 0
        return GenerationPlan(self.generation, prompts, self.cfg.prompt_room, self.settings.num_iterations, kept,
                              rounds)

    def keeps_reference_adapter(self) -> bool:  # a run from model.adapter with a KL term: TRL's "ref" copy
        return bool(self.cfg.model.adapter) and self.settings.beta != 0.0

    def keeps_old_logps(self) -> bool:
        """The log-probabilities at generation, the ratio's denominator, kept where a generation serves steps."""
        return self.settings.num_iterations > 1

    def keeps_reference_logps(self) -> bool:
        """The reference's (KL's), computed at generation."""
        return self.settings.beta != 0.0

    def planned_batches(self) -> list[Batch]:
        return full_length_batches(self.cfg, self.planned_rows())

    def planned_micro_step(self, model: nn.Module, batch: Batch, device: torch.device) -> None:
        """The update's micro-step: the policy's log-probabilities at the temperature, TRL's loss over them (the
        kept and reference log-probabilities where the recipe keeps them, advantages of zero) and its backward."""
        coefficient = grpo_router_coefficient(model)
        forward = self.forward_loss.token_logps(model, batch, device, self.generation.temperature,
                                                router_aux=coefficient is not None)
        kept = forward.logps.detach() if self.keeps_old_logps() else None
        reference = forward.logps.detach() if self.keeps_reference_logps() else None
        trade = model_trade(model)
        terms = TokenTerms(forward.logps, kept, reference, torch.zeros(batch.numbered_samples(), device=device),
                           batch.target_samples().to(device), batch.numbered_samples(),
                           trade.group if trade is not None else None, batch.counts_once())
        share = self.update_share(terms, StepCounts(batch.numbered_samples(), max(batch.n_targets, 1)))
        if forward.router_aux is not None and coefficient is not None:
            share = share + counted_once(coefficient * forward.router_aux, batch)
        share.backward()
