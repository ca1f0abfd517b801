"""Plant known bugs one at a time and check that the test guarding each one fails.

Each mutation replaces one exact snippet of a committed file, runs the guarding test, and restores the file
(also on Ctrl-C). Before planting anything it checks every entry of the list: its snippet occurs exactly once in
its file, the planted file still compiles, its test exists. It refuses to start when a file it mutates has
uncommitted changes, so a restore can never lose work. Only a test that fails an assertion catches a bug (tests/
mutation_outcomes.py records how each test ended): a collection or setup error, an exception in the test's call or a
timeout is reported as an error, and a mutation no test fails on prints MISSED; either makes the exit code 1.

Each test runs in a fork of this process, which imported torch, transformers, PEFT and bitsandbytes once: a test
pays only for the repo's own modules (imported fresh in the fork, the planted bug with them), about 2 s instead of
10. This process never imports the repo's modules itself.

    python -m tests.mutation_check                 # all (about 6 minutes on 2 cores; --quick: 70 s)
    python -m tests.mutation_check blocksize norm  # those whose name contains a word
    python -m tests.mutation_check --quick         # those guarded by single-process tests of seconds (CI runs these)
    python -m tests.mutation_check --baseline      # first each guarding test without a bug: it must pass
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parent.parent
# what every guarding test imports, loaded once before the forks (never the repo's own modules)
# what the guarding tests import from outside the repo, their lazily imported parts included (FSDP2, DTensor, dynamo,
# Llama's modeling, matplotlib, TRL): a quarter less CPU a planted bug than torch and transformers alone
WARM_MODULES = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
                "torch.distributed.checkpoint", "torch._dynamo", "transformers", "transformers.modeling_utils",
                "transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama", "peft",
                "bitsandbytes", "accelerate", "trl", "datasets", "safetensors.torch", "matplotlib.pyplot", "yaml",
                "pytest")
TEST_TIMEOUT_S = 600.0
PYTEST_ARGS = ["-q", "-x", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning"]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    original: str
    planted: str
    test: str
    quick: bool = False  # its guarding test runs in one process (no ranks, torchrun) in seconds: the set CI runs


BAD_TOOLS = "tests/test_grpo_tools.py::test_bad_tools_environments_and_calls_fail_in_one_line_or_as_the_tools_message"
VISION_GRPO = "tests/test_grpo_images.py::test_grpo_with_images_generates_and_updates_as_transformers_and_trl[{}]"
PREQUANTIZED_TINY = ("tests/test_prequantized.py::"
                     "test_tiny_tied_prequantized_trains_at_world_sizes_1_and_2_equal_to_transformers")

OBJECTIVE_GUARD = "tests/test_layers.py::test_objectives_are_told_apart_in_the_table_and_validation_only"
LOOP_EVALUATED = "            evaluated = any(key in record for key in self.objective.EVAL_METRICS)\n"
# (form, file, snippet, the snippet with a dispatch planted)
OBJECTIVE_DISPATCHES = [
    ("a comparison", "qlora_fsdp/training/loop.py", LOOP_EVALUATED,
     '            evaluated = "eval_loss" in record or self.cfg.train.objective == "grpo"\n'),
    ("a local alias", "qlora_fsdp/training/loop.py", LOOP_EVALUATED,
     '            name = self.cfg.train.objective\n            evaluated = name in ("sft", "dpo")\n'),
    ("match", "qlora_fsdp/training/loop.py", LOOP_EVALUATED,
     "            match self.cfg.train.objective:\n                case _:\n                    evaluated = True\n"),
    ("a dict's get", "qlora_fsdp/training/loop.py", LOOP_EVALUATED,
     '            evaluated = {"grpo": "eval_reward"}.get(self.cfg.train.objective, "eval_loss") in record\n'),
    ("isinstance", "qlora_fsdp/objectives/pair_steps.py", "    if not pair_loss.kl_pass:\n",
     '    if not isinstance(pair_loss, KtoLoss):  # noqa: F821\n'),
    ("a kind's field", "qlora_fsdp/plan/report.py", "    generates = planned_generation(cfg) is not None\n",
     '    generates = cfg.train.kind.data == "prompts"\n'),
    ("the kind read in the planner", "qlora_fsdp/plan/time_report.py",
     "    grpo = planned_generation(cfg) is not None\n", "    grpo = cfg.train.kind.generates\n"),
]

MUTATIONS = [
    # ---- the training step, optimizer, sharding, precision -------------------------------------------------
    Mutation("every family let past the support matrix's gate", "qlora_fsdp/families.py",
             "    if allowed or config.model_type in CHECKED_FAMILIES:", "    if True:",
             "tests/test_support_matrix.py::test_a_family_not_checked_is_refused_at_load_in_one_line_unless_asked_for",
             quick=True),
    Mutation("each micro-batch's gradients dropped before the next", "qlora_fsdp/objectives/supervised.py",
             "        return accumulate_gradients(self.parts.model, self.micro_batches(), self.parts.info.device,\n"
             "                                    self.forward_loss, loss_factor)\n",
             "        batches, model, device = self.micro_batches(), self.parts.model, self.parts.info.device\n"
             "        for batch in batches[:-1]:\n"
             "            accumulate_gradients(model, [batch], device, self.forward_loss, loss_factor)\n"
             "            model.zero_grad()\n"
             "        return accumulate_gradients(model, batches[-1:], device, self.forward_loss, loss_factor)\n",
             "tests/test_numerics.py::test_train_step_is_one_optimizer_update"),
    Mutation("the optimizer steps twice a step", "qlora_fsdp/training/loop.py",
             "        result = self.objective.step(scale)\n",
             "        result = self.objective.step(scale)\n        self.optimizer.step()\n",
             "tests/test_numerics.py::test_train_step_is_one_optimizer_update"),
    Mutation("gradient norm over the local shard only", "qlora_fsdp/optimizer.py",
             "    params = [p for p in model.parameters() if p.grad is not None]\n",
             "    with_grad = [p for p in model.parameters() if p.grad is not None]\n"
             "    params = [local_shard(p) for p in with_grad]\n"
             "    for local, param in zip(params, with_grad):\n"
             "        local.grad = local_shard(param.grad)\n",
             "tests/test_numerics.py::test_sharded_two_ranks_match_unsharded"),
    Mutation("offload switched off on CPU", "qlora_fsdp/loading/sharding.py",
             "    offload_policy = CPUOffloadPolicy(pin_memory=pin) if fsdp.cpu_offload else OffloadPolicy()\n",
             "    offload_policy = (CPUOffloadPolicy(pin_memory=pin) if fsdp.cpu_offload and device.type != 'cpu'\n"
             "                      else OffloadPolicy())\n",
             "tests/test_numerics.py::test_cpu_offload_matches_no_offload"),
    Mutation("chunked loss drops the last, shorter chunk", "qlora_fsdp/losses/tokens.py",
             "    total = hidden.new_zeros((), dtype=torch.float32)\n"
             "    for start in range(0, hidden.shape[0], chunk_tokens):\n",
             "    total = hidden.new_zeros((), dtype=torch.float32)\n"
             "    for start in range(0, hidden.shape[0] - chunk_tokens + 1, chunk_tokens):\n",
             "tests/test_loss_and_checkpointing.py::test_chunked_loss_equals_full_loss"),
    Mutation("the loss head skips the last target token", "qlora_fsdp/data/batching.py",
             "        self.target_positions = torch.nonzero(self.labels.flatten() != IGNORE_INDEX).flatten()\n",
             "        self.target_positions = torch.nonzero(self.labels.flatten() != IGNORE_INDEX).flatten()[:-1]\n",
             "tests/test_attention.py::test_training_loss_and_gradients_of_a_packed_batch_are_the_same_under_every_kernel",
             quick=True),
    Mutation("per-sample attention lets a packed row's samples see each other", "qlora_fsdp/data/batching.py",
             "            rows.append(list(zip(edges[:-1], edges[1:], strict=True)))\n",
             "            rows.append([(edges[0], edges[-1])])\n",
             "tests/test_attention.py::test_training_loss_and_gradients_of_a_packed_batch_are_the_same_under_every_kernel",
             quick=True),
    Mutation("float16 gradients not unscaled", "qlora_fsdp/training/loop.py",
             "        self.scaler.unscale_(self.model)\n", "",
             "tests/test_precision.py::test_float16_overflow_is_skipped_backs_off_and_resumes_bit_identically"),
    Mutation("the loss scale not restored on resume", "qlora_fsdp/training/loop.py",
             "        self.scaler.load_state_dict(state.get(\"loss_scaler\", {}))", "        pass",
             "tests/test_precision.py::test_float16_overflow_is_skipped_backs_off_and_resumes_bit_identically"),
    Mutation("a checkpoint does not end a metrics record", "qlora_fsdp/training/loop.py",
             "            if save or stats.skipped or evaluated or self.step % cfg.log_every == 0:",
             "            if stats.skipped or evaluated or self.step % cfg.log_every == 0:",
             "tests/test_resume.py::test_kill_during_checkpoint_write_keeps_the_previous_one"),
    Mutation("a skipped step averaged into its record", "qlora_fsdp/training/loop.py",
             "            if stats.skipped and self.window.records:", "            if False:",
             "tests/test_resume.py::test_non_finite_steps_are_skipped_then_stop_the_run"),
    Mutation("a record's rate averaged over its steps, not over its time", "qlora_fsdp/outputs/metrics.py",
             "            elif key in RATES:", "            elif False:",
             "tests/test_metrics.py::test_a_window_of_steps_reads_as_one_long_step", quick=True),
    # ---- fused LoRA ------------------------------------------------------------------------------------------
    Mutation("a fused group's members take each other's A products", "qlora_fsdp/layers/fused_lora.py",
             "        self.outputs = dict(enumerate(parts))\n",
             "        self.outputs = dict(enumerate(reversed(parts)))\n",
             "tests/test_fused_lora.py::test_a_group_projects_once_and_again_for_a_new_input", quick=True),
    Mutation("the fused B product drops the LoRA scaling", "qlora_fsdp/layers/fused_lora.py",
             "                       alpha=scaling)\n", "                       alpha=1.0)\n",
             "tests/test_fused_lora.py::test_fused_projections_give_peft_s_loss_and_gradients"),
    # ---- preference tuning: the losses, the pair step, pair encoding, the precomputed reference --------------
    Mutation("IPO regresses summed log-ratios, not per-token averages", "qlora_fsdp/losses/pair_formulas.py",
             "    if loss_type == \"ipo\":\n        policy, reference = policy.averaged(), reference.averaged()\n", "",
             "tests/test_preference_loss.py::test_dpo_losses_are_the_published_formulas", quick=True),
    Mutation("a tied pair counts as a wrong preference", "qlora_fsdp/losses/pair_formulas.py",
             "        return (self.chosen > self.rejected).float() + 0.5 * (self.chosen == self.rejected).float()\n",
             "        return (self.chosen > self.rejected).float()\n",
             "tests/test_preference_loss.py::test_dpo_is_log_2_where_policy_equals_reference", quick=True),
    Mutation("a batch's chosen and rejected sequences swapped", "qlora_fsdp/losses/pair_losses.py",
             "    return PairLogps(sequence_logps[0::2], sequence_logps[1::2], tokens[0::2], tokens[1::2])\n",
             "    return PairLogps(sequence_logps[1::2], sequence_logps[0::2], tokens[1::2], tokens[0::2])\n",
             "tests/test_preference_training.py::test_dpo_log_probabilities_equal_transformers_log_softmax"),
    Mutation("the pair step counts each sequence as a pair", "qlora_fsdp/losses/pair_losses.py",
             "    return (batch.n_samples // 2, int(batch.targets_per_sample()[0::2].sum()),",
             "    return (batch.n_samples, int(batch.targets_per_sample()[0::2].sum()),",
             "tests/test_preference_training.py::test_dpo_starts_at_log_2_and_accumulation_and_sharding_change_nothing"),
    Mutation("completions that start alike: their shared tokens taken as prompt", "qlora_fsdp/data/pair_encoding.py",
             "    while start and chosen.labels[start - 1] != IGNORE_INDEX:\n        start -= 1\n", "",
             "tests/test_preference_data.py::test_only_the_completions_are_targets_under_published_templates",
             quick=True),
    Mutation("truncation halves the budget instead of keeping the shorter completion whole",
             "qlora_fsdp/data/pair_encoding.py",
             "    keep_chosen = min(chosen, max(budget - rejected, budget // 2))\n",
             "    keep_chosen = min(chosen, budget // 2)\n",
             "tests/test_preference_data.py::test_fitting_keeps_the_prompt_and_shortens_the_longer_completion_first",
             quick=True),
    Mutation("precomputed reference read as all chosen, then all rejected", "qlora_fsdp/objectives/pair_reference.py",
             "        table[ids] = logps.view(-1, 2).float()\n", "        table[ids] = logps.view(2, -1).t().float()\n",
             "tests/test_preference_training.py::"
             "test_precomputed_reference_trains_as_the_adapter_off_one_and_a_stale_one_is_refused"),
    # ---- GRPO: advantages, the policy loss, rewards ---------------------------------------------------------------
    Mutation("advantages divided by the std without TRL's epsilon", "qlora_fsdp/losses/policy.py",
             "        advantages = advantages / (nan_std(groups, dim=1).unsqueeze(1) + STD_EPSILON)\n",
             "        advantages = advantages / nan_std(groups, dim=1).unsqueeze(1)\n",
             "tests/test_grpo.py::test_advantages_are_trls_group_and_batch_normalization", quick=True),
    Mutation("KL term without TRL's ratio weighting", "qlora_fsdp/losses/policy.py",
             "        losses = losses + grpo.beta * (torch.exp(gap) - gap - 1) * ratio\n",
             "        losses = losses + grpo.beta * (torch.exp(gap) - gap - 1)\n",
             "tests/test_grpo.py::test_the_update_equals_trls_at_world_sizes_1_and_2"),
    Mutation("GSPO's sequence ratio from the summed log-ratios", "qlora_fsdp/losses/policy.py",
             "        log_ratio = per_sample_mean(log_ratio, terms.sample_ids, terms.n_samples, terms.split)"
             "[terms.sample_ids]\n",
             "        log_ratio = log_ratio.new_zeros(terms.n_samples).index_add(0, terms.sample_ids, log_ratio)"
             "[terms.sample_ids]\n",
             "tests/test_grpo.py::test_the_update_equals_trls_at_world_sizes_1_and_2"),
    Mutation("a None score makes the whole reward NaN", "qlora_fsdp/rewards/functions.py",
             "    total = torch.nansum(weighted, dim=1)\n",
             "    total = weighted.sum(dim=1)\n",
             "tests/test_grpo.py::test_rewards_built_in_and_errors_in_one_line", quick=True),
    Mutation("a mixture of experts' load-balancing loss counted once a rank, not once a micro-batch",
             "qlora_fsdp/objectives/grpo.py",
             "            micro_batches = len(generation.micro_batches) * self.split.data_ranks\n",
             "            micro_batches = self.split.data_ranks\n",
             "tests/test_grpo.py::test_a_mixture_of_experts_update_equals_trls_with_its_load_balancing_loss"),
    Mutation("a packed row's padding tail counted as real tokens", "qlora_fsdp/data/batching.py",
             "            mask[row, : sum(lengths[:n])] = 1\n", "            mask[row, : sum(lengths)] = 1\n",
             "tests/test_grpo.py::test_a_mixture_of_experts_update_equals_trls_with_its_load_balancing_loss"),
    Mutation("the logged entropy from the logits before the temperature", "qlora_fsdp/losses/tokens.py",
             "        log_probs = scaled.log_softmax(-1)\n", "        log_probs = logits.float().log_softmax(-1)\n",
             "tests/test_grpo.py::test_the_update_equals_trls_at_world_sizes_1_and_2"),
    Mutation("the plan's KV cache keeps keys only", "qlora_fsdp/generation/room.py",
             "    per_token = 2 * kv_heads * head_dim(hf) * itemsize\n",
             "    per_token = kv_heads * head_dim(hf) * itemsize\n",
             "tests/test_plan.py::test_generations_kv_cache_is_what_transformers_generate_keeps", quick=True),
    Mutation("a completion's EOS cut off with it", "qlora_fsdp/objectives/rollouts.py",
             "            return row[: index + 1], False\n", "            return row[:index], False\n",
             "tests/test_grpo.py::test_a_completion_ends_at_its_first_eos_and_only_a_cut_one_is_truncated",
             quick=True),
    Mutation("a completion that ended at its EOS flagged truncated", "qlora_fsdp/objectives/rollouts.py",
             "            return row[: index + 1], False\n", "            return row[: index + 1], True\n",
             "tests/test_grpo.py::test_a_completion_ends_at_its_first_eos_and_only_a_cut_one_is_truncated",
             quick=True),
    Mutation("a completion keeps the padding after its EOS", "qlora_fsdp/objectives/rollouts.py",
             "            return row[: index + 1], False\n", "            return row, False\n",
             "tests/test_grpo.py::test_the_whole_step_from_generated_ids_equals_trls"),
    Mutation("a completion cut at max_completion_length not flagged truncated", "qlora_fsdp/objectives/rollouts.py",
             "        return row, True\n", "        return row, False\n",
             "tests/test_grpo.py::test_the_whole_step_from_generated_ids_equals_trls"),
    Mutation("bnpo's micro-batches counted on one rank", "qlora_fsdp/objectives/grpo.py",
             "                          StepCounts(completions, n_tokens, len(micro_batches) * self.split.data_ranks), "
             "metrics,\n",
             "                          StepCounts(completions, n_tokens, len(micro_batches)), metrics,\n",
             "tests/test_grpo.py::test_the_whole_step_from_generated_ids_equals_trls"),
    Mutation("the split layout hands each rank another rank's rows", "qlora_fsdp/generation/layouts.py",
             "        dist.scatter(mine, parts, src=self.owner, group=self.group)\n",
             "        dist.scatter(mine, parts[::-1], src=self.owner, group=self.group)\n",
             "tests/test_families.py::test_family_equals_transformers_and_peft_at_world_sizes_1_and_2[llama]"),
    Mutation("a generation layout keeps the gathered model after the call", "qlora_fsdp/generation/layouts.py",
             "        for module, reshard in zip(modules, before, strict=True):\n            module.reshard()\n",
             "        for module, reshard in zip(modules, before, strict=True):\n            pass\n",
             "tests/test_grpo.py::test_two_ranks_whose_generations_end_apart_stay_in_step_and_sample_what_they_update"),
    # ---- vision-language: images into the embeddings, the image side as the reference holds it --------------------
    Mutation("a packed row's pixels land on the wrong sample", "qlora_fsdp/data/batching.py",
             "    parts = [part for part in inputs if part is not None]\n",
             "    parts = [part for part in reversed(inputs) if part is not None]\n",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[llava]"),
    Mutation("image features never reach the embeddings", "qlora_fsdp/vision/image_embeddings.py",
             "        return output.masked_scatter(mask.unsqueeze(-1), features[before : before + here].to(output.dtype"
             "))\n",
             "        return output\n",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[llava]"),
    Mutation("the vision tower kept unquantized where transformers makes it 4-bit",
             "qlora_fsdp/loading/vision_encoder.py",
             "        if type(module) is not nn.Linear or prefix + name not in names:\n",
             "        if True:\n",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[llava]"),
    Mutation("a packed row's masks built whole (the sliding layers' image overlay lost after the first sample)",
             "qlora_fsdp/vision/image_embeddings.py",
             "    if positions is None or padding is not None:  # one sample a row\n",
             "    if True:  # one sample a row\n",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[gemma3]"),
    Mutation("the per-sample kernel ignores a given mask", "qlora_fsdp/layers/attention.py",
             "    if isinstance(attention_mask, torch.Tensor):  # a mask made for the batch",
             "    if False:  # a mask made for the batch",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[gemma3]"),
    Mutation("Qwen2.5-VL's image tokens keep text positions (no grid positions per sample)",
             "qlora_fsdp/vision/image_positions.py",
             "                if n_images:\n", "                if False:\n",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[qwen2_5_vl]"),
    Mutation("generation's new tokens after an image not moved by the prompt's position delta",
             "qlora_fsdp/vision/image_positions.py",
             'return None if self.deltas is None else (args, {**kwargs, "position_ids": self.shifted(kwargs, ids)})',
             "return None",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[qwen2_5_vl]"),
    Mutation("Qwen3-VL's deepstack features never reach the decoder's first layers",
             "qlora_fsdp/vision/image_embeddings.py",
             "    if encoded.deepstack is not None:\n", "    if False:\n",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[qwen3_vl]"),
    Mutation("Llama 3.2 Vision: every token reads every image state of its row (other samples' and the zero one)",
             "qlora_fsdp/vision/cross_attention_images.py",
             "        mask[index, 0, :, : row.reads.shape[1]] = row.reads\n",
             "        mask[index, 0, :, : row.reads.shape[1]] = True\n",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[mllama]"),
    Mutation("Llama 3.2 Vision: a sample with images also reads the zero state",
             "qlora_fsdp/vision/cross_attention_images.py",
             "            allowed[start:end, 0] = False\n", "            allowed[start:end, 0] = True\n",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[mllama]"),
    Mutation("a trained image side's gradients not summed over the ranks (each rank steps on its own)",
             "qlora_fsdp/distributed/grad_sync.py", "    if not params:\n        return\n",
             "    if True:\n        return\n",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[llava]"),
    Mutation("merge adds the tower's LoRA to its stored weights, not the 4-bit ones it trained on",
             "qlora_fsdp/tools/adapter_merge.py", '    return {key for key in updates.linear if key in four_bit and '
             '"language_model" not in key}\n', "    return set()\n",
             "tests/test_vision.py::test_train_py_learns_from_images_with_a_trained_image_side_and_merges_it"),
    Mutation("quant.vision_tower: unquantized ignored (the tower made 4-bit anyway)",
             "qlora_fsdp/loading/vision_encoder.py",
             '    if cfg.quant.vision_tower == "auto":\n', "    if True:\n",
             "tests/test_vision.py::test_the_plans_image_side_is_the_built_encoders_bytes[llava]", quick=True),
    Mutation("a tiled MLP's weight gradients taken from its last tile only", "qlora_fsdp/layers/tiled_mlp.py",
             "list(found[len(wanted):]) if not grads else", "list(found[len(wanted):]) if True else",
             "tests/test_loss_and_checkpointing.py::test_every_checkpointing_policy_equals_none"),
    Mutation("a tile's input gradient written at the row's start", "qlora_fsdp/layers/tiled_mlp.py",
             "grad_x.narrow(ctx.dim, start, part.shape[ctx.dim])", "grad_x.narrow(ctx.dim, 0, part.shape[ctx.dim])",
             "tests/test_loss_and_checkpointing.py::test_every_checkpointing_policy_equals_none"),
    Mutation("q, k and v fused under attention-side tiles (the group's cache holds the row)",
             "qlora_fsdp/layers/fused_lora.py", "return (MLP_GROUP,) if attention_tiled else SHARED_INPUT_GROUPS",
             "return SHARED_INPUT_GROUPS",
             "tests/test_step_memory.py::test_attention_side_tiles_lower_the_planned_peak"),
    Mutation("the blockwise kernel casts the whole row to fp32", "qlora_fsdp/layers/blockwise_attention.py",
             "        q, k, v = grouped(query, kv_heads), key[:, :, None], value[:, :, None]\n        out = ",
             "        q, k, v = grouped(query.float(), kv_heads), key[:, :, None], value[:, :, None]\n        out = ",
             "tests/test_attention.py::test_windows_soft_capping_and_sinks_never_hold_a_tokens_by_tokens_tensor",
             quick=True),
    Mutation("a decoding step priced with every tile's dequantization", "qlora_fsdp/measure/step_tracker.py",
             "            done.distinct_dequant_elements = done.dequant_elements\n", "",
             "tests/test_step_memory.py::test_planned_peak_is_the_real_steps"),
    Mutation("a split row's parts joined in the wrong order around attention", "qlora_fsdp/layers/split_rows.py",
             "        traded = self._trade(parts)  # [source rank = part",
             "        traded = self._trade(parts).flip(0)  # [source rank = part",
             "tests/test_context_parallel.py::test_a_row_split_over_two_ranks_equals_it_whole"),
    Mutation("a split row's sinks not cut to the rank's heads", "qlora_fsdp/layers/split_rows.py",
             "return per_head.chunk(self.degree)[self.index]", "return per_head.chunk(self.degree)[0]",
             "tests/test_context_parallel.py::test_a_row_split_over_two_ranks_equals_it_whole"),
    Mutation("a split row's per-sample sums left as each rank's part", "qlora_fsdp/losses/forward.py",
             "return sums if trade is None else summed_over_split(sums, trade.group)", "return sums",
             "tests/test_kto.py::test_kto_equals_trls_kto_trainer_and_accumulates_and_shards_exactly"),
    Mutation("a split row's pair losses counted by every rank of the split", "qlora_fsdp/objectives/pair_steps.py",
             "    if not batch.counts_once():\n        return 0.0\n", "",
             "tests/test_preference_training.py::test_reference_free_objectives_accumulate_and_split_rows_exactly"),
    Mutation("a split row's rewards all read at the row's first token", "qlora_fsdp/objectives/row_shards.py",
             "    last = batch.last_tokens()  # flat", "    last = batch.last_tokens() * 0  # flat",
             "tests/test_reward_model.py::test_reward_model_equals_trls_reward_trainer_and_accumulates_and_shards_exactly"),
    Mutation("the load-balancing loss weighted by a split part's targets", "qlora_fsdp/losses/forward.py",
             "counted_once(aux * batch.whole_batch_targets(), batch)", "aux * batch.n_targets",
             "tests/test_context_parallel.py::test_a_row_split_over_two_ranks_equals_it_whole"),
    Mutation("a split row's part takes the row's first image features", "qlora_fsdp/vision/image_embeddings.py",
             "    before = 0 if part is None else part.image_tokens_before(encoder.image_token_id)",
             "    before = 0",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[llava]"),
    Mutation("GRPO's completion means left as each split rank's part", "qlora_fsdp/losses/policy.py",
             "        sums = all_reduced_over_split(sums, split)\n"
             "        counts = all_reduced_over_split(counts, split)", "        pass",
             "tests/test_grpo.py::test_the_update_equals_trls_at_world_sizes_1_and_2"),
    Mutation("GRPO's completion means over a split backpropagate each rank's own terms only",
             "qlora_fsdp/distributed/split_sums.py",
             "        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), \"sum\", ctx.group)), None",
             "        return grad, None", "tests/test_grpo.py::test_the_update_equals_trls_at_world_sizes_1_and_2"),
    Mutation("GRPO's kept log-probabilities not cut to a split part's tokens", "qlora_fsdp/objectives/grpo.py",
             "        here = slice(batch.targets_before(), batch.targets_before() + logps.numel())",
             "        here = slice(0, logps.numel())",
             "tests/test_grpo.py::test_the_update_equals_trls_at_world_sizes_1_and_2"),
    Mutation("a split row's part takes the row's first grid positions", "qlora_fsdp/vision/image_positions.py",
             "        out[1:] = whole[1:, :, self.part.start : self.part.start + positions.shape[-1]]",
             "        out[1:] = whole[1:, :, : positions.shape[-1]]",
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[qwen2_5_vl]"),
    Mutation("a split row's part takes the row's first deepstack rows", "qlora_fsdp/vision/image_embeddings.py",
             '"deepstack_visual_embeds": [layer[before : before + here] for layer in deepstack]}',
             '"deepstack_visual_embeds": [layer[:here] for layer in deepstack]}',
             "tests/test_vision.py::test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2[qwen3_vl]"),
    Mutation("generation's blockwise prompt forward ignores the left padding",
             "qlora_fsdp/layers/generation_attention.py",
             "    starts = (~real).sum(-1).tolist()\n    if any(", "    starts = [0] * rows\n    if False and any(",
             "tests/test_attention.py::test_generation_of_capped_and_sink_families_equals_eager_with_the_prompt_in_"
             "linear_memory", quick=True),
    Mutation("the ranks of a split row take different rows", "qlora_fsdp/training/loop.py",
             "self.split.data_ranks, self.split.data_rank, cfg.train.seed,",
             "info.world_size, info.rank, cfg.train.seed,",
             "tests/test_resume.py::test_elastic_restart_then_sigterm_then_kill_9_then_resume_equals_the_uninterrupted_"
             "run"),
    Mutation("LoRA+ speeds up the A matrices instead of the B ones", "qlora_fsdp/optimizer.py",
             '("lora_B" in name.split(".") or param.ndim == 1)', '("lora_A" in name.split(".") or param.ndim == 1)',
             "tests/test_peer_options.py::test_loraplus_groups_and_step"),
    Mutation("NEFTune's noise scaled by the hidden size alone", "qlora_fsdp/layers/embedding_noise.py",
             "math.sqrt(embeddings.shape[1] * embeddings.shape[2])", "math.sqrt(embeddings.shape[2])",
             "tests/test_peer_options.py::test_neftune_noise_is_transformers"),
    Mutation("KTO's undesirable loss pushes the wrong way", "qlora_fsdp/losses/kto.py",
             "(1 - F.sigmoid(beta * (z0 - ratio)))", "(1 - F.sigmoid(beta * (ratio - z0)))",
             "tests/test_kto.py::test_kto_equals_trls_kto_trainer_and_accumulates_and_shards_exactly"),
    Mutation("KTO's z0 taken over the rank's records only", "qlora_fsdp/objectives/pair_steps.py",
             "    summed, count = all_reduce_sums([summed, count], device)\n", "",
             "tests/test_kto.py::test_kto_equals_trls_kto_trainer_and_accumulates_and_shards_exactly"),
    Mutation("KTO's KL completion is the record's own", "qlora_fsdp/data/kto_records.py",
             "batch[\"chosen\"][usable[position - 1]]", "batch[\"chosen\"][usable[position]]",
             "tests/test_kto.py::test_kto_records_pair_each_prompt_with_the_previous_completion"),
    Mutation("a reward model scores each sequence's second-to-last token", "qlora_fsdp/data/batching.py",
             "ends = [row * width + end - 1 for row", "ends = [row * width + end - 2 for row",
             "tests/test_reward_model.py::test_reward_model_equals_trls_reward_trainer_and_accumulates_and_shards_"
             "exactly"),
    Mutation("a reward pair's margin added instead of subtracted", "qlora_fsdp/losses/pair_formulas.py",
             "gap = chosen - rejected - (margin", "gap = chosen - rejected + (margin",
             "tests/test_reward_model.py::test_reward_model_equals_trls_reward_trainer_and_accumulates_and_shards_"
             "exactly"),
    Mutation("new tokens' rows start at zero instead of the stored rows' mean", "qlora_fsdp/loading/fill.py",
             "full.mean(0, keepdim=True).expand(", "0 * full.mean(0, keepdim=True).expand(",
             "tests/test_peer_options.py::test_embeddings_trained_beside_lora_equal_peft_modules_to_save"),
    Mutation("trained embeddings learn at optim.lr", "qlora_fsdp/optimizer.py",
             "ratio = (lora.embeddings_lr or optim.lr) / optim.lr", "ratio = 1.0",
             "tests/test_peer_options.py::test_embeddings_trained_beside_lora_equal_peft_modules_to_save"),
    Mutation("the plan counts trained embeddings' optimizer state as 8-bit", "qlora_fsdp/measure/held.py",
             "id(param) in full_state)", "False)", "tests/test_plan.py::test_planned_sizes_equal_measured"),
    Mutation("PiSSA's base keeps the whole weight", "qlora_fsdp/layers/lora_inits.py",
             "return InitialAdapter(a, b, weight - scale * (b.float() @ a.float()))",
             "return InitialAdapter(a, b, weight)",
             "tests/test_lora_inits.py::test_inits_equal_peft_and_the_4bit_residual_is_within_one_nf4_step"),
    Mutation("a converted start saved with B0's sign kept", "qlora_fsdp/loading/initial_adapter.py",
             "adapter_state[b_key], -b0.to(", "adapter_state[b_key], b0.to(",
             "tests/test_lora_inits.py::test_the_saved_adapter_is_peft_rank_2r_and_merges_to_the_live_logits"),
    Mutation("LoftQ's factors left unscaled", "qlora_fsdp/layers/lora_inits.py",
             "    root = scale ** 0.5\n", "    root = 1.0\n",
             "tests/test_lora_inits.py::test_loftq_starts_at_the_weight_at_any_alpha"),
    Mutation("a tied head's second name refused by the merge", "qlora_fsdp/tools/adapter_merge.py",
             "*(set(self.replaced) - written_twice)", "*self.replaced",
             "tests/test_peer_options.py::test_a_tied_head_trains_as_one_tensor_saved_under_both_names_and_merges"),
    Mutation("EVA reads the inputs of the tokens before the targets", "qlora_fsdp/training/eva_start.py",
             "    mask[..., 1:] = targets[..., :-1]\n", "    mask = targets\n",
             "tests/test_lora_inits.py::test_eva_starts_as_peft_eva_on_the_same_micro_batches"),
    Mutation("image tokens counted as targets", "qlora_fsdp/data/images.py",
             "    out = [IGNORE_INDEX] * len(expanded)\n", "    out = list(expanded)\n",
             "tests/test_vision.py::test_records_become_replies_only_labels_with_each_images_tokens", quick=True),
    Mutation("OLoRA's B from Q's last columns", "qlora_fsdp/layers/lora_inits.py",
             "    return upper[:r].contiguous(), q[:, :r].contiguous()\n",
             "    return upper[:r].contiguous(), q[:, -r:].contiguous()\n",
             "tests/test_lora_inits.py::test_inits_equal_peft_and_the_4bit_residual_is_within_one_nf4_step[olora]"),
    Mutation("a split row's labels one token late", "qlora_fsdp/objectives/row_shards.py",
             "    local_labels = labels[part].view(1, width)\n",
             "    local_labels = labels.roll(1)[part].view(1, width)\n",
             "tests/test_context_parallel.py::test_a_row_split_over_two_ranks_equals_it_whole"),
    # ---- the planner: memory, step time ----------------------------------------------------------------------
    Mutation("plan counts the gradient shard while accumulating", "qlora_fsdp/measure/held.py",
             "    return held.lora_elements * accumulated_grad_itemsize(cfg)\n",
             "    return held.grads\n", "tests/test_plan.py::test_planned_sizes_equal_measured"),
    Mutation("an all-gather counts the whole gathered tensor as received", "qlora_fsdp/measure/op_work.py",
             "gather_bytes=nbytes(output) - nbytes(shard),", "gather_bytes=nbytes(output),",
             "tests/test_step_time.py::test_the_fake_step_counts_the_models_work"),
    Mutation("transfers hide wholly behind compute", "qlora_fsdp/plan/step_time.py",
             "        time.total = max(busy, link) + min(busy, link) / work.layers\n",
             "        time.total = max(busy, link)\n",
             "tests/test_step_time.py::test_transfers_hide_behind_compute_but_for_one_layer", quick=True),
    # ---- ranks: first contact, errors ------------------------------------------------------------------------
    Mutation("a first all-reduce that sums too little passes", "qlora_fsdp/distributed/first_contact.py",
             "    if total != world:  # a broken", "    if total > world:  # a broken",
             "tests/test_first_contact.py::test_a_wrong_sum_or_a_hang_is_one_user_error", quick=True),
    Mutation("a GPU report keeps JSON's string keys for peer GPUs", "qlora_fsdp/distributed/first_contact.py",
             "    record[\"peer_access\"] = {int(index): flag for index, flag in record[\"peer_access\"].items()}",
             "    record[\"peer_access\"] = dict(record[\"peer_access\"])",
             "tests/test_first_contact.py::test_a_report_survives_the_store_as_json", quick=True),
    Mutation("a peer's failed collective is taken as its own crash", "qlora_fsdp/commands/exit.py",
             "            end_if_peer_failed()  # returns when no peer published a user error: then the error is "
             "ours\n",
             "            pass\n",
             "tests/test_rank_errors.py::test_a_failed_collective_after_a_peers_user_error_ends_quietly_with_2",
             quick=True),
    # ---- config ----------------------------------------------------------------------------------------------
    Mutation("recipes read off/on/yes/no as YAML 1.1 booleans", "qlora_fsdp/config/loader.py",
             "RecipeLoader.yaml_implicit_resolvers = {\n",
             "RecipeLoader.yaml_implicit_resolvers = yaml.SafeLoader.yaml_implicit_resolvers or {\n",
             "tests/test_config.py::test_yes_no_on_off_are_strings_where_strings_are_expected", quick=True),
    # ---- model family code: build.py, loading.py, attention.py, weight_files.py, names.py, tools/tiny_model.py ----
    Mutation("sliding windows ignored by per-sample attention", "qlora_fsdp/layers/attention.py",
             '        return cls(kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux"), '
             'dropout, chunk)\n',
             '        return cls(None, kwargs.get("softcap"), kwargs.get("s_aux"), dropout, chunk)\n',
             "tests/test_attention.py::test_per_sample_attention_computes_windows_sinks_and_soft_capping_as_the_"
             "family_defines_them[gemma2]", quick=True),
    Mutation("attention sinks take no softmax mass", "qlora_fsdp/layers/blockwise_attention.py",
             "            if sink is None:\n", "            if True:\n",
             "tests/test_attention.py::test_per_sample_attention_computes_windows_sinks_and_soft_capping_as_the_"
             "family_defines_them[gpt_oss]", quick=True),
    Mutation("soft-capping skipped", "qlora_fsdp/layers/blockwise_attention.py",
             "            scores = torch.tanh(scores / self.softcap) * self.softcap\n", "            pass\n",
             "tests/test_attention.py::test_per_sample_attention_computes_windows_sinks_and_soft_capping_as_the_"
             "family_defines_them[gemma2]", quick=True),
    Mutation("sdpa picked for a family whose sinks it cannot compute", "qlora_fsdp/layers/attention.py",
             '            return "sdpa" if needs.sdpa_exact else refuse_blockwise_dropout(VARLEN_SDPA, needs)\n',
             '            return "sdpa"\n',
             "tests/test_attention.py::test_a_kernel_that_cannot_compute_the_family_is_never_picked_and_refused_"
             "when_asked_for", quick=True),
    Mutation("per-sample attention drops no probabilities in training (Seed-OSS's attention dropout)",
             "qlora_fsdp/layers/attention.py",
             "        return causal_sdpa(query, key, value, scaling, options.dropout)\n",
             "        return causal_sdpa(query, key, value, scaling)\n",
             "tests/test_attention.py::test_attention_dropout_is_applied_as_transformers_sdpa_applies_it_and_refused_"
             "where_our_kernel_has_none", quick=True),
    Mutation("a packed row's samples share the Gated DeltaNet's state", "qlora_fsdp/layers/decoder.py",
             "    if bounds is None or all(len(row) == 1 for row in bounds)", "    if True or bounds is None",
             "tests/test_families.py::test_family_equals_transformers_and_peft_at_world_sizes_1_and_2[qwen3_5]"),
    Mutation("computed buffers left as to_empty leaves them", "qlora_fsdp/loading/fill.py",
             "        module.register_buffer(name, value.to(device), persistent=persistent)\n",
             "        module.register_buffer(name, torch.zeros_like(value).to(device), persistent=persistent)\n",
             "tests/test_families.py::test_family_equals_transformers_and_peft_at_world_sizes_1_and_2[gemma3]"),
    Mutation("a layer that drops the position ids leaves its attention without them", "qlora_fsdp/layers/decoder.py",
             "    if kept is None or kwargs.get(\"position_ids\") is not None:", "    if True:",
             "tests/test_families.py::test_family_equals_transformers_and_peft_at_world_sizes_1_and_2[llama4]"),
    Mutation("chunked attention's chunks ignored", "qlora_fsdp/layers/attention.py",
             "    if options.chunk is not None and query.shape[2] > options.chunk:",
             "    if False:",
             "tests/test_families.py::test_family_equals_transformers_and_peft_at_world_sizes_1_and_2[llama4]"),
    Mutation("the planner's layer kinds blind to a dense first layer", "qlora_fsdp/measure/fake_step.py",
             "    return tuple(numbered[layout] for layout in layouts)",
             "    return tuple(0 for layout in layouts)",
             "tests/test_step_memory.py::test_shortened_runs_give_the_whole_models_figures"),
    Mutation("the repeat beside a dense layer taken for a middle one", "qlora_fsdp/measure/fake_step.py",
             "    return dataclasses.replace(repeats, edge=repeats.edge + 1) if head_differs or tail_differs "
             "else repeats",
             "    return repeats",
             "tests/test_step_memory.py::test_shortened_runs_give_the_whole_models_figures"),
    Mutation("a multimodal decoder's keys left under language_model", "qlora_fsdp/loading/layout.py",
             "            return self.decoder_prefix + key.removeprefix(self.text_prefix)\n",
             "            return key\n",  # the family test's loading refuses it (an error): this one asserts the keys
             "tests/test_families.py::test_both_multimodal_layouts_are_read_through_transformers_rules"),
    Mutation("a number over a tensor divided as torch divides it (reciprocal, then product)",
             "qlora_fsdp/gguf_target/quantizers.py",
             "    inverse = f32(nmax) / torch.where(flat, ones, high - offset)\n",
             "    inverse = nmax / torch.where(flat, ones, high - offset)\n",
             "tests/test_export_target.py::test_each_type_is_llama_cpps_rounding_on_real_weights", quick=True),
    Mutation("a block's sums taken as a tree sum, not one element after another",
             "qlora_fsdp/gguf_target/quantizers.py",
             "    total = terms[..., 0, :]\n",
             "    return terms.sum(dim=-2)\n",
             "tests/test_export_target.py::test_each_type_is_llama_cpps_rounding_on_real_weights", quick=True),
    Mutation("a k-quant's block search kept after the adapter changed", "qlora_fsdp/gguf_target/through_export.py",
             "        return not all(torch.equal(a, b)",
             "        return False and not all(torch.equal(a, b)",
             "tests/test_export_target.py::test_the_block_search_is_made_again_once_the_adapter_changes", quick=True),
    Mutation("llama.cpp's more-bits layers of a k-quant mix ignored", "qlora_fsdp/gguf_target/tensor_types.py",
             "        if use_more_bits(int(match.group(1)), shape.n_layers):\n",
             "        if False:\n",
             "tests/test_export_target.py::test_training_computes_with_the_gguf_llama_cpp_writes"),
    Mutation("the export's rounding skipped in the forward", "qlora_fsdp/gguf_target/through_export.py",
             "        out[rows] = rounded_chunk(merged, ggml_type, rows_steps)\n",
             "        out[rows] = merged\n",
             "tests/test_export_target.py::test_the_backward_is_loras_through_the_rounded_weight", quick=True),
    Mutation("the rounding kernel's k-quant values left unrounded", "qlora_fsdp/kernels/export_rounding.py",
             "            value = step * q - offset\n",
             "            value = m\n",
             "tests/test_export_target.py::test_training_computes_with_the_gguf_llama_cpp_writes"),
    Mutation("the rounding kernel's ties rounded up, not to even", "qlora_fsdp/kernels/export_rounding.py",
             "        return (x + ROUNDING_MAGIC) - ROUNDING_MAGIC\n",
             "        return tl.floor(x + 0.5)\n",
             "tests/test_export_target.py::test_the_rounding_kernel_is_the_torch_rounding", quick=True),
    Mutation("the q6_K search kernel takes the last of tied magnitudes, not the first",
             "qlora_fsdp/kernels/export_rounding.py",
             "            peak = tl.where(tl.abs(x) > tl.abs(peak), x, peak)\n",
             "            peak = tl.where(tl.abs(x) >= tl.abs(peak), x, peak)\n",
             "tests/test_export_target.py::test_the_rounding_kernel_is_the_torch_rounding", quick=True),
    Mutation("the export kernels launched with Triton's fused multiply-adds", "qlora_fsdp/kernels/export_rounding.py",
             'LAUNCH_OPTIONS = {"enable_fp_fusion": False}',
             'LAUNCH_OPTIONS = {"enable_fp_fusion": True}',
             "tests/test_export_target.py::test_the_kernels_compile_for_cuda_with_exact_float_instructions",
             quick=True),
    Mutation("the rounding kernel's bfloat16 written by truncation", "qlora_fsdp/kernels/export_rounding.py",
             "((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)",
             "(bits >> 16)",
             "tests/test_export_target.py::test_the_rounding_kernel_is_the_torch_rounding", quick=True),
    Mutation("a LoRA GGUF's B rows left as PEFT orders them (llama.cpp's q and k permutation skipped)",
             "qlora_fsdp/tools/lora_gguf_writer.py",
             '            writer.add_tensor(f"{gguf_name}.lora_b", lora_b[rows].numpy()',
             '            writer.add_tensor(f"{gguf_name}.lora_b", lora_b.numpy()',
             "tests/test_export_target.py::test_training_computes_with_the_gguf_llama_cpp_writes"),
    Mutation("a LoRA GGUF's alpha written as PEFT's lora_alpha (rsLoRA's scale lost)", "qlora_fsdp/tools/lora_gguf.py",
             "    return LoraPairs(pairs, scaling * rank)",
             '    return LoraPairs(pairs, float(config["lora_alpha"]))',
             "tests/test_export_target.py::test_a_lora_gguf_refuses_what_it_cannot_carry", quick=True),
    Mutation("the export's block search priced in every micro-batch the plan counts",
             "qlora_fsdp/gguf_target/through_export.py",
             "        tile_work_end(steps[0], chunks / counted_for - 1 if counted_for else -1.0)",
             "        tile_work_end(steps[0], chunks - 1 if counted_for else -1.0)",
             "tests/test_export_target.py::test_the_planner_prices_a_search_once_a_step", quick=True),
    Mutation("a multimodal checkpoint's head left under language_model (Llama 4)", "qlora_fsdp/loading/layout.py",
             "            return self.head_name + key.removeprefix(self.full_head_name)\n",
             "            return key\n",
             "tests/test_families.py::test_both_multimodal_layouts_are_read_through_transformers_rules"),
    Mutation("a multimodal adapter's targets match the vision tower too", "qlora_fsdp/loading/adapter.py",
             "    if decoder_only is not None:", "    if False:",
             "tests/test_families.py::test_family_equals_transformers_and_peft_at_world_sizes_1_and_2"
             "[gemma3_multimodal]"),
    Mutation("routing weights ignored by the 4-bit experts", "qlora_fsdp/layers/experts4bit.py",
             "        weighted = torch.cat(outputs) * top_k_weights.flatten()[routes.order, None]\n",
             "        weighted = torch.cat(outputs)\n",
             "tests/test_experts4bit.py::test_4bit_experts_compute_the_familys_experts_on_the_rounded_matrices"
             "[mixtral]", quick=True),
    Mutation("the experts' backward multiplies by a bf16 copy of the matrix", "qlora_fsdp/layers/experts4bit.py",
             "        weight = ctx.matrix.dequantize(row).to(grad.dtype)\n",
             "        weight = ctx.matrix.dequantize(row).to(torch.bfloat16).to(grad.dtype)\n",
             "tests/test_experts4bit.py::test_the_dequantizing_matmul_gives_the_gradient_of_the_rounded_matrix",
             quick=True),
    Mutation("MXFP4's two values of a byte read high nibble first", "qlora_fsdp/loading/stored_forms.py",
             "    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)\n",
             "    return convert_moe_packed_tensors((blocks << 4) | (blocks >> 4), scales, dtype=dtype)\n",
             "tests/test_mxfp4.py::test_a_byte_holds_its_blocks_even_element_in_the_low_nibble", quick=True),
    Mutation("the trained router's input cast cut from the graph", "qlora_fsdp/layers/expert_lora.py",
             "            a.to(next(mod.parameters()).dtype) if torch.is_tensor(a)",
             "            a.data.to(next(mod.parameters()).dtype) if torch.is_tensor(a)",
             "tests/test_experts4bit.py::test_trained_routers_compute_in_lora_dtype_and_pass_their_gradient_down",
             quick=True),
    Mutation("an expert's gate and up projections joined in the wrong order", "qlora_fsdp/loading/reader.py",
             "torch.cat([tensor.read() for _, tensor in parts])",
             "torch.cat([tensor.read() for _, tensor in parts[::-1]])",
             "tests/test_families.py::test_experts_load_the_same_4bit_bytes_from_every_checkpoint_form"),
    Mutation("the load-balancing loss computed but not added", "qlora_fsdp/losses/forward.py",
             "            total = total + counted_once(aux * batch.whole_batch_targets(), batch)\n",
             "            total = total\n",
             "tests/test_families.py::test_the_load_balancing_loss_is_added_as_transformers_adds_it"),
    Mutation("gpt-oss's expert biases dropped", "qlora_fsdp/layers/experts4bit.py",
             "        if self.has_bias:\n", "        if False:\n",
             "tests/test_families.py::test_family_equals_transformers_and_peft_at_world_sizes_1_and_2[gpt_oss]"),
    Mutation("the experts' LoRA B read expert-major, not PEFT's interleaved layout",
             "qlora_fsdp/layers/lora_math.py",  # one definition: training's update and the merge's delta both read it
             "b.unflatten(1, (r, n_experts)).permute(2, 1, 0)", "b.unflatten(1, (n_experts, r)).permute(1, 2, 0)",
             "tests/test_families.py::test_family_equals_transformers_and_peft_at_world_sizes_1_and_2[qwen3_moe]"),
    Mutation("the merge leaves out the experts' LoRA", "qlora_fsdp/tools/adapter_merge.py",
             "        return delta.merged(expert, weight).to(weight.dtype)\n", "        return weight\n",
             "tests/test_families.py::test_family_equals_transformers_and_peft_at_world_sizes_1_and_2[gpt_oss]"),
    Mutation("trained routers zeroed by the LoRA init after loading", "qlora_fsdp/loading/fill.py",
             "        if not param.requires_grad or not is_lora_tensor(name) or ",
             "        if not param.requires_grad or ",
             "tests/test_families.py::test_family_equals_transformers_and_peft_at_world_sizes_1_and_2[gpt_oss]"),
    Mutation("quantize with blocksize 128", "qlora_fsdp/loading/nf4.py", "        blocksize=quant.blocksize,\n",
             "        blocksize=128,\n", "tests/test_numerics.py::test_packed_4bit_weights_unshard_byte_identical"),
    Mutation("double quantization off", "qlora_fsdp/loading/nf4.py",
             "        compress_statistics=quant.double_quant,\n", "        compress_statistics=False,\n",
             "tests/test_numerics.py::test_packed_4bit_weights_unshard_byte_identical"),
    Mutation("bf16 packed storage", "qlora_fsdp/loading/build.py", "QUANT_STORAGE = torch.uint8\n",
             "QUANT_STORAGE = torch.bfloat16\n",
             "tests/test_numerics.py::test_packed_weights_survive_cuda_copy_behaviour"),
    Mutation("the emulated CUDA copy rewrites float16's NaNs but not bf16's", "tests/cuda_copy.py",
             "READ_THROUGH_FLOAT = (torch.bfloat16, torch.float16)\n", "READ_THROUGH_FLOAT = (torch.float16,)\n",
             "tests/test_cuda_copy.py::test_the_emulated_copy_rewrites_nans_as_cudas_fused_copy_does", quick=True),
    Mutation("rsLoRA not passed to PEFT", "qlora_fsdp/loading/build.py",
             "        use_rslora=lora.use_rslora,", "        use_rslora=False,",
             "tests/test_rslora.py::test_exported_rslora_adapter_loads_in_peft_with_the_same_outputs", quick=True),
    Mutation("the bounds read from position ids merge a row's samples", "qlora_fsdp/layers/attention.py",
             "    return list(zip(edges[:-1], edges[1:], strict=False))\n",
             "    return [(0, position_ids.numel())]\n",
             "tests/test_attention.py::test_bounds_from_the_batch_lengths_equal_those_read_from_the_position_ids",
             quick=True),
    Mutation("a tied head left untied after to_empty", "qlora_fsdp/loading/fill.py", "    retie(tied)\n", "",
             "tests/test_materialize.py::test_materialize_keeps_a_tied_head_one_tensor", quick=True),
    Mutation("every rank copies rank 0's rows of a pre-quantized weight", "qlora_fsdp/loading/reader.py",
             "        rows = self.packed.read((first // itemsize, -(-last // itemsize)))",
             "        rows = self.packed.read((0, -(-(last - first) // itemsize)))", PREQUANTIZED_TINY),
    Mutation("the merge writes a stored 4-bit weight without its LoRA update", "qlora_fsdp/tools/adapter_merge.py",
             "        return [(piece.stored_key, updated_linear(updates, piece.full_key, piece.dequantized()))]",
             "        return [(piece.stored_key, (updated_linear(updates, piece.full_key, piece.dequantized()), "
             "piece.dequantized())[1])]", PREQUANTIZED_TINY),
    Mutation("pre-quantized weights dequantize to their stored dtype", "qlora_fsdp/loading/stored_forms.py",
             "        state.dtype = self.dtype\n", "", PREQUANTIZED_TINY),
    # ---- multi-turn GRPO: tools and environments ------------------------------------------------------------
    Mutation("tool turns trained on", "qlora_fsdp/objectives/turns.py",
             "        rollout.policy += [0] * len(suffix)\n", "        rollout.policy += [1] * len(suffix)\n",
             "tests/test_grpo_tools.py::test_multi_turn_rollouts_with_tools_and_an_environment_equal_trls"),
    Mutation("the tool turn cut before the call's EOS", "qlora_fsdp/objectives/tool_templates.py",
             "    before = before[: ends[-1] + 1] if ends else before\n",
             "    before = before[: ends[-1]] if ends else before\n",
             "tests/test_grpo_tools.py::test_multi_turn_rollouts_with_tools_and_an_environment_equal_trls"),
    Mutation("a malformed call run with what could be read", "qlora_fsdp/agents/call_formats.py",
             "    if malformed:\n        return Reply(text.strip(), [], reasoning, malformed)\n", "",
             BAD_TOOLS, quick=True),
    Mutation("a tool's result read as the final answer", "qlora_fsdp/rewards/builtin.py",
             'message.get("role", "assistant") == "assistant"', "True",
             BAD_TOOLS, quick=True),
    # ---- vision GRPO: images in the prompts ----------------------------------------------------------------
    Mutation("the update's completions without their prompt's images", "qlora_fsdp/objectives/grpo_records.py",
             "    return Sample(prompt + completion, [IGNORE_INDEX] * len(prompt) + targets, vision)\n",
             "    return Sample(prompt + completion, [IGNORE_INDEX] * len(prompt) + targets)\n",
             VISION_GRPO.format("qwen2_5_vl")),
    Mutation("Gemma 3's generation masks let a row attend to its left padding", "qlora_fsdp/vision/image_embeddings.py",
             "    return (last if last.dtype == torch.bool else last == 0).long()\n",
             "    return torch.ones_like(ids)\n", VISION_GRPO.format("gemma3")),
    Mutation("GRPO's reference the base though the run continues an adapter", "qlora_fsdp/objectives/grpo.py",
             "        return bool(self.cfg.model.adapter) and self.settings.beta != 0.0\n",
             "        return False\n", VISION_GRPO.format("qwen2_5_vl")),
    Mutation("RLOO's baseline divided by the group, not the others", "qlora_fsdp/objectives/rloo.py",
             "    baselines = (torch.nansum(groups, dim=1, keepdim=True) - groups) / (scored - 1)\n",
             "    baselines = (torch.nansum(groups, dim=1, keepdim=True) - groups) / scored\n",
             "tests/test_rloo.py::test_rloo_equals_trls_rloo_trainer_at_world_sizes_1_and_2"),
    Mutation("RLOO's KL penalty added to the reward", "qlora_fsdp/objectives/rloo.py",
             "            rewards = rewards - self.rloo.beta * kl.to(rewards.dtype)\n",
             "            rewards = rewards + self.rloo.beta * kl.to(rewards.dtype)\n",
             "tests/test_rloo.py::test_rloo_equals_trls_rloo_trainer_at_world_sizes_1_and_2"),
    Mutation("RLOO's ratio a token's, not the completion's", "qlora_fsdp/objectives/rloo.py",
             "        return torch.exp(sequence_sums(terms.logps - old, terms))\n",
             "        return torch.exp(sequence_sums(terms.logps - old, terms) / 4)\n",
             "tests/test_rloo.py::test_rloo_equals_trls_rloo_trainer_at_world_sizes_1_and_2"),
    Mutation("generation.layout auto split though it does not fit", "qlora_fsdp/generation/plan.py",
             "    if world_size > 1 and split_fits():\n", "    if world_size > 1:\n",
             "tests/test_grpo.py::test_one_generation_plan_and_one_layout_rule_for_the_run_and_the_plan", quick=True),
    Mutation("a call's rows not capped at the rank's completions", "qlora_fsdp/generation/plan.py",
             "        return max(1, min(self.settings.rows or self.completions, self.completions))\n",
             "        return max(1, self.settings.rows or self.completions)\n",
             "tests/test_grpo.py::test_one_generation_plan_and_one_layout_rule_for_the_run_and_the_plan", quick=True),
    Mutation("the planner reads GRPO's own section", "qlora_fsdp/measure/image_side.py",
             "        rows = max(rows, made.rows)\n", "        rows = max(rows, made.rows * cfg.grpo.num_iterations)\n",
             "tests/test_layers.py::test_a_generating_objectives_settings_are_read_in_objectives_and_config_only",
             quick=True),
    Mutation("the step key leaves out a key the step reads", "qlora_fsdp/measure/step_setting.py",
             '    "quant.quant_type", "lora.alpha",', '    "quant.quant_type", "lora.alpha", "lora.r",',
             "tests/test_step_setting.py::test_the_step_key_changes_exactly_where_the_measured_step_does"),
    Mutation("the step key keeps a key the step does not read", "qlora_fsdp/measure/step_setting.py",
             '    "optim.lr", "optim.weight_decay",', '    "optim.weight_decay",',
             "tests/test_step_setting.py::test_the_step_key_changes_exactly_where_the_measured_step_does"),
    Mutation("the image side's key leaves out a key it reads", "qlora_fsdp/measure/image_side.py",
             '                    "quant.blocksize", "quant.double_quant",',
             '                    "quant.double_quant",',
             "tests/test_vision.py::test_the_image_side_key_changes_exactly_where_the_image_side_does"),
    Mutation("the planner keeps state in a module", "qlora_fsdp/measure/fake_world.py",
             "    if key not in planning.steps:\n",
             "    global LAST_KEY\n    LAST_KEY = key\n    if key not in planning.steps:\n",
             "tests/test_layers.py::test_the_planner_keeps_no_cache_of_its_own", quick=True),
    Mutation("a metric's held-out twin drawn apart", "qlora_fsdp/outputs/plots.py",
             '        (name, (name, f"eval_{name}") if f"eval_{name}" in evals else (name,)) for name in progress]\n',
             "        (name, (name,)) for name in progress]\n",
             "tests/test_plots.py::test_grpo_rloo_and_kto_runs_plot_what_their_objectives_log", quick=True),
    Mutation("a prompt's pictures put after its text", "qlora_fsdp/data/prompt_images.py",
             '[{"type": "image"} for _ in pictures] + text', 'text + [{"type": "image"} for _ in pictures]',
             "tests/test_grpo_images.py::test_image_prompt_forms_and_bad_input_in_one_line", quick=True),
    # ---- GGUF export and its Modelfile (tests/test_gguf_export.py: the converter runs, so none is quick) ---------
    Mutation("a GGUF asked for as bf16 written as f16", "qlora_fsdp/tools/gguf_export.py",
             '"--outtype", outtype, "--outfile"', '"--outtype", {"bf16": "f16"}.get(outtype, outtype), "--outfile"',
             "tests/test_gguf_export.py::test_tiny_families_export_and_read_back_equal[gemma3-bf16]"),
    Mutation("an f16 GGUF's merge rounded to bfloat16", "qlora_fsdp/tools/gguf_export.py",
             '"f16": "float16", "bf16": "bfloat16"', '"f16": "bfloat16", "bf16": "bfloat16"',
             "tests/test_gguf_export.py::test_f16_export_of_an_adapter_computes_peft_on_the_base"),
    Mutation("a GGUF of an adapter converted from its base", "qlora_fsdp/commands/export.py",
             '    return work / "merged", arch\n', "    return model_dir(cfg), arch\n",
             "tests/test_gguf_export.py::test_f16_export_of_an_adapter_computes_peft_on_the_base"),
    Mutation("the Modelfile leaves out the template's default system prompt", "qlora_fsdp/tools/ollama.py",
             "        if translation.system:\n", "        if False:\n",
             "tests/test_gguf_export.py::test_modelfile_translates_the_chatml_template_with_its_default_system_prompt"),
    Mutation("the Modelfile's TEMPLATE written with its newlines escaped", "qlora_fsdp/tools/ollama.py",
             "    return '\"\"\"' + text + '\"\"\"'\n",
             "    return '\"\"\"' + text.replace(\"\\n\", \"\\\\n\") + '\"\"\"'\n",
             "tests/test_gguf_export.py::test_modelfile_translates_the_chatml_template_with_its_default_system_prompt"),
    # ---- the studio ---------------------------------------------------------------------------------------
    Mutation("the studio's form sends every field as an override", "qlora_fsdp/studio/form.py",
             "            if value is not None and override_text(f, value) != override_text(f, form_value(cfg, f))]\n",
             "            if value is not None]\n",
             "tests/test_studio.py::test_the_form_holds_every_key_of_the_reference_with_its_choices_and_a_recipe_round_trips",
             quick=True),
    Mutation("the studio's curves keep a resumed run's first values of a repeated step",
             "qlora_fsdp/outputs/plots.py",
             "                series[key][int(record[\"step\"])] = float(value)\n",
             "                series[key].setdefault(int(record[\"step\"]), float(value))\n",
             "tests/test_studio.py::test_a_running_runs_files_are_read_by_complete_lines_as_curves_progress_and_completions",
             quick=True),
    Mutation("the studio's time left counts from the start, not the resume", "qlora_fsdp/studio/live.py",
             "            since = (int(record[\"step\"]), record[\"time\"])\n",
             "            pass\n",
             "tests/test_studio.py::test_a_running_runs_files_are_read_by_complete_lines_as_curves_progress_and_completions",
             quick=True),
    Mutation("the studio's lever leaves its keys in the free-text box", "qlora_fsdp/studio/session.py",
             "        kept = [line for line in extra.splitlines() if line.partition(\"=\")[0].strip() not in changes]"
             "\n",
             "        kept = extra.splitlines()\n",
             "tests/test_studio.py::test_a_lever_sets_its_keys_in_the_form_and_the_form_then_means_them", quick=True),
    Mutation("the studio's stop signals torchrun rather than its ranks", "qlora_fsdp/studio/runs.py",
             "        for pid in ranks or [run.process.pid]:",
             "        for pid in [run.process.pid]:",
             "tests/test_studio.py::test_stop_signals_each_rank_once", quick=True),
    Mutation("the studio's chat workers inherit the server's distributed world", "qlora_fsdp/studio/chat.py",
             "                                        text=True, bufsize=1, env=child_environment())\n",
             "                                        text=True, bufsize=1)\n",
             "tests/test_studio.py::test_chat_workers_stream_the_reply_qlora_generate_prints_and_two_answer_side_by_side"),
    Mutation("the studio's plan server lets a superseded plan run on", "qlora_fsdp/studio/plan_server.py",
             "                    os.kill(pid, signal.SIGKILL)\n                    ended += 1\n",
             "                    pass\n",
             "tests/test_studio.py::test_the_plan_worker_a_newer_request_ends_an_older_and_a_lever_applied_plans_what_it_promised"),
    # ---- torch releases, flex attention, the offline GPU machine --------------------------------------------
    Mutation("flex attention lets short grouped-query rows take the decoding kernel",
             "qlora_fsdp/layers/flex_attention.py",
             "        options.setdefault(\"FORCE_USE_FLEX_ATTENTION\", True)\n",
             "        pass\n",
             "tests/test_attention.py::test_flex_short_queries_take_the_main_kernel", quick=True),
    Mutation("the grouped-query flop fix counts the key/value heads", "qlora_fsdp/torch_versions.py",
             "        heads = query[1]\n",
             "        heads = key[1]\n",
             "tests/test_torch_versions.py::test_flop_counter_counts_grouped_query_sdpa", quick=True),
    Mutation("the fake-tensor fix lets a dispatching Parameter subclass through", "qlora_fsdp/torch_versions.py",
             "    return issubclass(kind, nn.Parameter) and kind.__torch_dispatch__ is torch.Tensor.__torch_dispatch__"
             "\n",
             "    return issubclass(kind, nn.Parameter)\n",
             "tests/test_torch_versions.py::test_fake_tensors_pass_metadata_only_parameter_subclasses", quick=True),
    Mutation("the GPU wheels keep every CUDA runtime of bitsandbytes", "scripts/gpu_wheels.py",
             "            if item.filename in dropped:\n",
             "            if False:\n",
             "tests/test_gpu_wheels.py::test_bitsandbytes_keeps_one_cuda_runtime_and_the_cpu_library", quick=True),
    # ---- GRPO's fused decoding kernels (Triton's interpreter) ---------------------------------------------
    Mutation("the fused NF4 kernel reads the next element's absmax block", "qlora_fsdp/kernels/nf4_matmul.py",
             "        block = element // BLOCKSIZE\n",
             "        block = (element + 1) // BLOCKSIZE\n",
             "tests/test_kernels.py::test_the_kernels_dequantized_weight_is_bitsandbytes_bit_for_bit", quick=True),
    Mutation("the fused NF4 kernel's epilogue drops LoRA's scale", "qlora_fsdp/kernels/nf4_matmul.py",
             "input_precision=\"ieee\") * lora_scale\n",
             "input_precision=\"ieee\")\n",
             "tests/test_kernels.py::test_the_fused_matmul_is_bitsandbytes_and_peft_within_summation_order",
             quick=True),
    Mutation("decode attention reads the cache past its filled length", "qlora_fsdp/kernels/decode_attention.py",
             "                live = slots < length\n",
             "                live = slots < L\n",
             "tests/test_kernels.py::test_decode_attention_reads_only_the_filled_cache_with_grouped_heads_and_padding",
             quick=True),
    Mutation("the decoding loop stops a row one step after its end id", "qlora_fsdp/kernels/decoding_loop.py",
             "    state.unfinished &= ~torch.isin(token, state.ends)\n",
             "    state.unfinished &= ~torch.isin(state.tokens[:, 0], state.ends)\n",
             "tests/test_kernels.py::test_the_decoding_loop_equals_generate_tokens_log_probabilities_and_padding",
             quick=True),
    Mutation("DFT's token weights carry a gradient", "qlora_fsdp/losses/tokens.py",
             "    return (losses * weight(losses.detach())).sum()\n", "    return (losses * weight(losses)).sum()\n",
             "tests/test_dft.py::test_dft_equals_trls_dft_loss_over_two_ranks_chunked_or_not"),
    Mutation("DFT's held-out loss weighted too", "qlora_fsdp/objectives/dft.py",
             "        return self.plain_loss\n", "        return self.forward_loss\n",
             "tests/test_dft.py::test_the_dft_recipe_plans_trains_evaluates_and_logs"),
    Mutation("the studio's Resume keeps the stop's progress line", "qlora_fsdp/studio/live.py",
             "            state.finished = state.stopped_by_signal = False\n", "",
             "tests/test_studio.py::"
             "test_a_running_runs_files_are_read_by_complete_lines_as_curves_progress_and_completions", quick=True),
    Mutation("the studio's fix under a chosen preset does nothing", "qlora_fsdp/studio/session.py",
             "                base = load_config(recipe, preset)\n", "                pass\n",
             "tests/test_studio.py::test_a_lever_sets_its_keys_in_the_form_and_the_form_then_means_them", quick=True),
    Mutation("the studio dies when its port answers late", "qlora_fsdp/studio/app.py",
             "show_error=True, _frontend=False)\n", "show_error=True)\n",
             "tests/test_st"
             "udio.py::test_the_page_starts_when_its_port_answers_late_and_its_events_never_drop_an_edit", quick=True),
    Mutation("the studio skips an edit made while a plan runs", "qlora_fsdp/studio/events.py",
             'EVERY_EDIT = "multiple"', 'EVERY_EDIT = "once"',
             "tests/test_st"
             "udio.py::test_the_page_starts_when_its_port_answers_late_and_its_events_never_drop_an_edit", quick=True),
    Mutation("the studio's reopened page lists the adapters of its start", "qlora_fsdp/studio/events.py",
             "    page.load(find, None, [after.adapter, after.adapter_b])", "",
             "tests/test_st"
             "udio.py::test_the_page_starts_when_its_port_answers_late_and_its_events_never_drop_an_edit", quick=True),
    Mutation("the studio reloads the form when a cleared path names the same recipe", "qlora_fsdp/studio/session.py",
             "        if name == shown:\n", "        if False:\n",
             "tests/test_studio.py::test_the_form_keeps_its_edits_and_the_plan_is_of_the_ranks_that_launch",
             quick=True),
    Mutation("the studio plans one rank where two launch", "qlora_fsdp/studio/session.py",
             "        return with_ranks(draft, ranks), \"\"\n", "        return draft, \"\"\n",
             "tests/test_studio.py::test_the_form_keeps_its_edits_and_the_plan_is_of_the_ranks_that_launch",
             quick=True),
    Mutation("the studio shows its own run in place of a followed folder", "qlora_fsdp/studio/session.py",
             "        run = self.shown_run()\n", "        run = self.runs.current\n",
             "tests/test_studio.py::"
             "test_the_run_view_reads_the_files_again_only_when_they_grew_and_says_how_the_run_ended", quick=True),
    Mutation("the studio starts a plan for every edit of a burst", "qlora_fsdp/studio/plan_worker.py",
             "            if mine != self.requests:\n                return None\n", "",
             "tests/test_studio.py::"
             "test_the_plan_worker_a_newer_request_ends_an_older_and_a_lever_applied_plans_what_it_promised"),
    Mutation("the studio plans a draft it has planned again", "qlora_fsdp/studio/plan_worker.py",
             "            if key in self.done:", "            if False:",
             "tests/test_studio.py::"
             "test_the_plan_worker_a_newer_request_ends_an_older_and_a_lever_applied_plans_what_it_promised"),
    Mutation("the plan server forgets the steps its plans measured", "qlora_fsdp/studio/plan_server.py",
             "        take_measured_steps(Path(request[\"out\"]).parent, steps)\n", "",
             "tests/test_studio.py::"
             "test_the_plan_worker_a_newer_request_ends_an_older_and_a_lever_applied_plans_what_it_promised"),
    Mutation("the plan server ends the plan measuring the step a newer request needs",
             "qlora_fsdp/studio/plan_server.py", "        awaited = children.measurer(key)\n",
             "        awaited = None\n",
             "tests/test_studio.py::"
             "test_the_plan_worker_a_newer_request_ends_an_older_and_a_lever_applied_plans_what_it_promised"),
    Mutation("the studio's error line read as HTML", "qlora_fsdp/studio/events.py",
             "{html.escape(line)}</span>", "{line}</span>",
             "tests/test_studio.py::test_an_error_line_shows_every_word_of_the_message", quick=True),
    Mutation("the studio launches zero ranks", "qlora_fsdp/studio/preflight.py", "    if ranks < 1:\n",
             "    if ranks < 0:\n",
             "tests/test_studio.py::"
             "test_a_launch_into_a_used_folder_or_a_resume_of_nothing_is_refused_in_the_command_lines_words",
             quick=True),
    Mutation("the studio launches without reading the data first", "qlora_fsdp/studio/preflight.py",
             "        if local_path(source.path):  # a hub dataset is fetched by the run itself\n",
             "        if not local_path(source.path):\n",
             "tests/test_studio.py::test_a_launch_checks_data_model_and_gpus_first_in_the_runs_own_words", quick=True),
    # ---- the objective boundary: each form of telling objectives apart outside the table ----------------------
    *(Mutation(f"objectives told apart by {form}", path, original, planted, OBJECTIVE_GUARD, quick=True)
      for form, path, original, planted in OBJECTIVE_DISPATCHES),
]


def marked_slow(source: str, definition: int) -> bool:
    """The test defined at offset `definition` is in the slow lane (pool ranks, torchrun, other processes): by its
    module's pytestmark or one of its own decorators (the lines right above its def)."""
    if re.search(r"^pytestmark = .*mark\.slow", source, re.MULTILINE):
        return True
    return "mark.slow" in source[:definition].split("\n\n")[-1]  # the decorators: after the last blank line


def entry_problems(mutation: Mutation) -> list[str]:
    """What keeps an entry from planting its bug: a snippet not found exactly once, a planted file that does not
    compile, a guarding test that does not exist; a quick entry's test in the slow lane."""
    path, (test_file, _, test_name) = REPO / mutation.path, mutation.test.partition("::")
    text = path.read_text() if path.is_file() else ""
    found = text.count(mutation.original)
    if found != 1:
        return [f"'{mutation.name}': {mutation.path} holds its snippet {found} times, not once; update the entry"]
    problems = []
    try:
        compile(text.replace(mutation.original, mutation.planted), mutation.path, "exec")
    except SyntaxError as err:
        problems.append(f"'{mutation.name}': the planted {mutation.path} does not compile: {err}")
    test_path = REPO / test_file
    function = test_name.partition("[")[0]  # a parametrized test's id names its case
    source = test_path.read_text() if test_path.is_file() else ""
    definition = re.search(rf"^def {re.escape(function)}\(", source, re.MULTILINE)
    if definition is None:
        problems.append(f"'{mutation.name}': no test {mutation.test}")
    elif mutation.quick and marked_slow(source, definition.start()):
        problems.append(f"'{mutation.name}': quick, but {mutation.test} is marked slow (ranks or processes)")
    return problems


def list_problems(mutations: list[Mutation]) -> list[str]:
    names = [m.name for m in mutations]
    twice = sorted({n for n in names if names.count(n) > 1})
    return [f"'{n}' names two entries" for n in twice] + [p for m in mutations for p in entry_problems(m)]


def warm_up() -> None:
    """Import the libraries the tests share, once; the repo's modules stay out, so each fork imports them fresh."""
    for module in WARM_MODULES:
        importlib.import_module(module)
    ours = [m for m in sys.modules if m.split(".")[0] == "qlora_fsdp" or (m.startswith("tests.") and m != __name__)]
    assert not ours, f"the repo's own modules imported before planting: {ours[:3]}"


def test_in_fork(test: str, log_fd: int, outcomes: Path) -> NoReturn:
    """The forked child: run the test, its output to `log_fd`, how each test ended to `outcomes`; never returns into
    the caller's frames."""
    code = 3
    try:
        os.setpgid(0, 0)  # a group of its own: a timeout ends its rank workers with it
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.chdir(REPO)
        import pytest

        from tests.mutation_outcomes import OutcomeRecorder

        code = int(pytest.main([*PYTEST_ARGS, test], plugins=[OutcomeRecorder(outcomes)]))
    finally:
        atexit._run_exitfuncs()  # the rank pool closes its workers at exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait_for(pid: int, timeout_s: float) -> int | None:
    """The child's exit code, or None when it ran past `timeout_s` (then it and its group are killed)."""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.1)
    except BaseException:  # Ctrl-C: the child goes too
        kill_group(pid)
        raise
    kill_group(pid)
    return None


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def run_test(test: str) -> tuple[int | None, str, list[dict]]:
    """(pytest's exit code or None on a timeout, its output, tests/mutation_outcomes.py's records) of the test in a
    fork of this warmed-up process."""
    handle, name = tempfile.mkstemp(suffix=".jsonl")  # not a TemporaryDirectory: the fork's exit would remove it
    os.close(handle)
    outcomes = Path(name)
    with tempfile.TemporaryFile() as log:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            test_in_fork(test, log.fileno(), outcomes)
        try:
            os.setpgid(pid, pid)  # also here: the child may not have run yet
        except (PermissionError, ProcessLookupError):
            pass  # it has, and its group is its own already
        code = wait_for(pid, TEST_TIMEOUT_S)
        log.seek(0)
        records = [json.loads(line) for line in outcomes.read_text().splitlines()]
        outcomes.unlink()
        return code, log.read().decode(errors="replace"), records


def verdict(code: int | None, output: str, outcomes: list[dict]) -> tuple[bool, str]:
    """(caught, what the table says): caught only where a test's call failed an assertion. A collection or setup
    error, an exception in the call (a crashed rank too), a hang or a test not found is an error, never a catch: the
    bug broke something the test did not claim to check."""
    evidence = " / ".join([line[1:].strip() for line in output.splitlines() if line.startswith("E ")][:2])
    if any(o["phase"] == "call" and o["outcome"] == "failed" and o["assertion"] for o in outcomes):
        return True, f"caught: {evidence}"
    if code is None:
        return False, f"ERROR: timed out after {TEST_TIMEOUT_S:.0f} s"
    errors = [f"{o['phase']} error ({o['exception'] or 'no exception'}) in {o['test']}" for o in outcomes
              if o["outcome"] == "failed"]
    if errors:
        return False, f"ERROR, not an assertion: {errors[0]}: {evidence}"
    if code == 0:
        ran = any(o["phase"] == "call" and o["outcome"] == "passed" for o in outcomes)
        return False, "MISSED" if ran else "ERROR: nothing ran (skipped)"
    tail = " / ".join(output.strip().splitlines()[-2:])
    return False, f"ERROR: pytest exit code {code}: {tail}"


def run_with(mutation: Mutation) -> tuple[bool, str]:
    """(caught, the table's result) for one planted bug; the file is restored whatever happens."""
    path = REPO / mutation.path
    text = path.read_text()
    path.write_text(text.replace(mutation.original, mutation.planted))
    try:
        code, output, outcomes = run_test(mutation.test)
    finally:
        path.write_text(text)
    return verdict(code, output, outcomes)


def failing_baselines(mutations: list[Mutation]) -> list[str]:
    """The guarding tests that fail with no bug planted (each would count any bug as caught)."""
    tests = list(dict.fromkeys(m.test for m in mutations))
    return [test for test in tests if run_test(test)[0] != 0]


def main(words: list[str]) -> int:
    quick, baseline = "--quick" in words, "--baseline" in words
    words = [w for w in words if w not in ("--quick", "--baseline")]
    problems = list_problems(MUTATIONS)  # every entry, chosen or not: CI runs --quick only
    if problems:
        print("error: the planted bugs' list is out of date:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    chosen = [m for m in MUTATIONS if (not words or any(w in m.name for w in words)) and (m.quick or not quick)]
    dirty = subprocess.run(["git", "diff", "--quiet", "--", *{m.path for m in chosen}], cwd=REPO).returncode
    if dirty:
        print("error: a file to mutate has uncommitted changes; commit or stash them first", file=sys.stderr)
        return 2
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as conftest sets it, before a warm import loads triton
    warm_up()
    failing = failing_baselines(chosen) if baseline else []
    if failing:
        print("error: these tests fail with no bug planted:\n  " + "\n  ".join(failing), file=sys.stderr)
        return 2
    print("| planted bug | guarding test | result | s |\n| --- | --- | --- | --- |")
    failures, began = 0, time.monotonic()
    for mutation in chosen:
        started = time.monotonic()
        caught, result = run_with(mutation)
        failures += not caught
        print(f"| {mutation.name} | `{mutation.test.split('::')[1]}` | {result} | "
              f"{time.monotonic() - started:.0f} |", flush=True)
    print(f"\n{len(chosen) - failures} of {len(chosen)} planted bugs caught in {time.monotonic() - began:.0f} s",
          file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
