"""Plant known bugs one at a time and check that the test guarding each one fails.

Each mutation replaces one exact snippet of a committed file, runs the guarding test, and restores the file
(also on Ctrl-C). It refuses to start when a file it mutates has uncommitted changes, so a restore can never
lose work. A mutation the test does not catch prints MISSED and makes the exit code 1.

    python -m tests.mutation_check                 # all (about 3 minutes on 2 cores)
    python -m tests.mutation_check blocksize norm  # those whose name contains a word
    python -m tests.mutation_check --quick         # those whose guarding tests take seconds (CI runs these)
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    original: str
    planted: str
    test: str
    quick: bool = False  # its guarding test takes seconds: in the --quick set CI runs


MUTATIONS = [
    Mutation("optimizer steps once per micro-batch", "qlora_fsdp/training/loop.py",
             "        result = accumulate_gradients(self.model, micro_batches, self.info.device, self.forward_loss, "
             "scale)\n",
             "        for batch in micro_batches[:-1]:\n"
             "            accumulate_gradients(self.model, [batch], self.info.device, self.forward_loss, scale)\n"
             "            self.optimizer.step()\n"
             "        result = accumulate_gradients(self.model, micro_batches[-1:], self.info.device,\n"
             "                                      self.forward_loss, scale)\n",
             "tests/test_numerics.py::test_train_step_is_one_optimizer_update"),
    Mutation("quantize with blocksize 128", "qlora_fsdp/model/loading.py", "        blocksize=quant.blocksize,\n",
             "        blocksize=128,\n", "tests/test_numerics.py::test_packed_4bit_weights_unshard_byte_identical",
             quick=True),
    Mutation("double quantization off", "qlora_fsdp/model/loading.py",
             "        compress_statistics=quant.double_quant,\n", "        compress_statistics=False,\n",
             "tests/test_numerics.py::test_packed_4bit_weights_unshard_byte_identical"),
    Mutation("gradient norm over the local shard only", "qlora_fsdp/training/optimizer.py",
             "    params = [p for p in model.parameters() if p.grad is not None]\n",
             "    with_grad = [p for p in model.parameters() if p.grad is not None]\n"
             "    params = [local_shard(p) for p in with_grad]\n"
             "    for local, param in zip(params, with_grad):\n"
             "        local.grad = local_shard(param.grad)\n",
             "tests/test_numerics.py::test_sharded_two_ranks_match_unsharded"),
    Mutation("offload switched off on CPU", "qlora_fsdp/model/sharding.py",
             "    offload_policy = CPUOffloadPolicy(pin_memory=pin) if fsdp.cpu_offload else OffloadPolicy()\n",
             "    offload_policy = (CPUOffloadPolicy(pin_memory=pin) if fsdp.cpu_offload and device.type != 'cpu'\n"
             "                      else OffloadPolicy())\n",
             "tests/test_numerics.py::test_cpu_offload_matches_no_offload"),
    Mutation("bf16 packed storage", "qlora_fsdp/model/build.py", "QUANT_STORAGE = torch.uint8\n",
             "QUANT_STORAGE = torch.bfloat16\n",
             "tests/test_numerics.py::test_packed_weights_survive_cuda_copy_behaviour"),
    Mutation("plan counts the gradient shard while accumulating", "qlora_fsdp/plan/held.py",
             "    return held.lora_elements * accumulated_grad_itemsize(cfg)\n",
             "    return held.grads\n", "tests/test_plan.py::test_planned_sizes_equal_measured"),
    Mutation("chunked loss drops the last, shorter chunk", "qlora_fsdp/model/loss.py",
             "    for start in range(0, hidden.shape[0], chunk_tokens):\n",
             "    for start in range(0, hidden.shape[0] - chunk_tokens + 1, chunk_tokens):\n",
             "tests/test_loss_and_checkpointing.py::test_chunked_loss_equals_full_loss"),
    Mutation("a peer's failed collective is taken as its own crash", "qlora_fsdp/commands/exit.py",
             "            end_if_peer_failed()  # returns when no peer published a user error: then the error is "
             "ours\n",
             "            pass\n",
             "tests/test_rank_errors.py::test_user_error_on_one_rank_mid_step"),
    Mutation("recipes read off/on/yes/no as YAML 1.1 booleans", "qlora_fsdp/config/loader.py",
             "RecipeLoader.yaml_implicit_resolvers = {\n",
             "RecipeLoader.yaml_implicit_resolvers = yaml.SafeLoader.yaml_implicit_resolvers or {\n",
             "tests/test_config.py::test_yes_no_on_off_are_strings_where_strings_are_expected", quick=True),
    Mutation("rsLoRA not passed to PEFT", "qlora_fsdp/model/build.py",
             "        use_rslora=lora.use_rslora,", "        use_rslora=False,",
             "tests/test_rslora.py::test_exported_rslora_adapter_loads_in_peft_with_the_same_outputs"),
    Mutation("per-sample attention lets a packed row's samples see each other", "qlora_fsdp/data/batching.py",
             "            rows.append(list(zip(edges[:-1], edges[1:], strict=True)))\n",
             "            rows.append([(edges[0], edges[-1])])\n",
             "tests/test_attention.py::test_training_loss_and_gradients_of_a_packed_batch_are_the_same_under_every_kernel",
             quick=True),
    Mutation("the bounds read from position ids merge a row's samples", "qlora_fsdp/model/attention.py",
             "    return list(zip(edges[:-1], edges[1:], strict=False))\n",
             "    return [(0, position_ids.numel())]\n",
             "tests/test_attention.py::test_bounds_from_the_batch_lengths_equal_those_read_from_the_position_ids",
             quick=True),
    Mutation("the loss head skips the last target token", "qlora_fsdp/data/batching.py",
             "        self.target_positions = torch.nonzero(self.labels.flatten() != IGNORE_INDEX).flatten()\n",
             "        self.target_positions = torch.nonzero(self.labels.flatten() != IGNORE_INDEX).flatten()[:-1]\n",
             "tests/test_attention.py::test_training_loss_and_gradients_of_a_packed_batch_are_the_same_under_every_kernel",
             quick=True),
    Mutation("a tied head left untied after to_empty", "qlora_fsdp/model/loading.py", "    retie(tied)\n", "",
             "tests/test_tied_weights.py::test_tied_model_loads_as_one_tensor_with_transformers_loss"),
    Mutation("float16 gradients not unscaled", "qlora_fsdp/training/loop.py",
             "        self.scaler.unscale_(self.model)\n", "",
             "tests/test_precision.py::test_float16_overflow_is_skipped_backs_off_and_resumes_bit_identically"),
    Mutation("the loss scale not restored on resume", "qlora_fsdp/training/loop.py",
             "        self.scaler.load_state_dict(state.get(\"loss_scaler\", {}))", "        pass",
             "tests/test_precision.py::test_float16_overflow_is_skipped_backs_off_and_resumes_bit_identically"),
]


def run_with(mutation: Mutation) -> tuple[bool, str]:
    """(caught, the first assertion lines) for one planted bug; the file is restored whatever happens."""
    path = REPO / mutation.path
    text = path.read_text()
    if text.count(mutation.original) != 1:
        raise SystemExit(f"error: {mutation.path} no longer holds the snippet for '{mutation.name}'; update it")
    path.write_text(text.replace(mutation.original, mutation.planted))
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", mutation.test],
                                cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    finally:
        path.write_text(text)
    evidence = [line[1:].strip() for line in result.stdout.splitlines() if line.startswith("E ")]
    return result.returncode != 0, " / ".join([line for line in evidence if line][:2])


def main(words: list[str]) -> int:
    quick = "--quick" in words
    words = [w for w in words if w != "--quick"]
    chosen = [m for m in MUTATIONS if (not words or any(w in m.name for w in words)) and (m.quick or not quick)]
    dirty = subprocess.run(["git", "diff", "--quiet", "--", *{m.path for m in chosen}], cwd=REPO).returncode
    if dirty:
        print("error: a file to mutate has uncommitted changes; commit or stash them first", file=sys.stderr)
        return 2
    print("| planted bug | guarding test | result |\n| --- | --- | --- |")
    missed = 0
    for mutation in chosen:
        caught, evidence = run_with(mutation)
        missed += not caught
        print(f"| {mutation.name} | `{mutation.test.split('::')[1]}` | "
              f"{'caught: ' + evidence if caught else 'MISSED'} |", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
