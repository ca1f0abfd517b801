"""Recipes, presets, overrides, and one-line errors with a non-zero exit."""

from __future__ import annotations

import pytest

from qlora_fsdp.config import changed_settings, load_config, to_yaml
from qlora_fsdp.config.loader import read_yaml_text
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.run.accelerators import GPUS
from tests.helpers import REPO, CliResult, train_here


def run_train(*args: str) -> CliResult:
    return train_here(list(args))


def test_overrides_are_typed_and_win_over_the_recipe():
    cfg = load_config("tiny_cpu", ["optim.lr=3e-4", "data.micro_batch_size=4", "lora.target_modules=[q_proj, v_proj]",
                                   "optim.max_grad_norm=null", "optim.weight_decay=0"])
    assert cfg.optim.lr == 3e-4 and cfg.data.micro_batch_size == 4
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.optim.max_grad_norm is None
    assert cfg.optim.weight_decay == 0.0 and isinstance(cfg.optim.weight_decay, float)


def test_recipe_path_and_fsdp_preset():
    cfg = load_config(str(REPO / "recipes" / "tiny_cpu.yaml"), ["fsdp_preset=full_shard_cpu_offload"])
    assert cfg.fsdp.cpu_offload is True
    cfg = load_config("tiny_cpu", ["fsdp_preset=full_shard_cpu_offload", "fsdp.cpu_offload=false"])
    assert cfg.fsdp.cpu_offload is False  # an explicit key beats the preset


@pytest.mark.parametrize("override, expected", [
    ("optim.lrr=3e-4", "unknown key 'optim.lrr' in the command-line overrides; did you mean 'optim.lr'?"),
    ("optim.name=sgd", "'optim.name' must be one of 'paged_adamw_8bit', 'adamw_8bit', 'adamw', got 'sgd'"),
    ("checkpointing.mode=off", "'checkpointing.mode' in the command-line overrides is now "
                               "'activation_checkpointing.mode': rename it"),
    ("optimm.lr=3e-4", "did you mean 'optim.lr'?"),
    ("data.grad_accum_steps=big", "'data.grad_accum_steps' must be an integer, got 'big'"),
    ("activation_checkpointing.mode=sometimes",
     "'activation_checkpointing.mode' must be one of 'every_layer', 'every_nth', 'first_last', 'layers', 'off'"),
    ("fsdp_preset=nope", "unknown fsdp_preset 'nope'"),
    ("optim.lr", "is not of the form key=value"),
    ("model.init=checkpoint", "'model.init: checkpoint' is now 'model.init: pretrained': rename it"),
    ("train.log_every=0", "'train.log_every' must be 1 (every step) or more, got 0"),
])
def test_bad_overrides_fail_in_one_line(override, expected):
    result = run_train("--recipe", "tiny_cpu", override, "--print-config")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr


def test_missing_recipe_names_the_nearest():
    result = run_train("--recipe", "tiny_cpuu")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: unknown recipe 'tiny_cpuu': did you mean 'tiny_cpu'? known recipes: " + \
        ", ".join(sorted(p.stem for p in (REPO / "recipes").glob("*.yaml")))


def test_unknown_key_in_a_recipe_file_names_the_file(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("optim:\n  learning_rate: 1.0e-4\n")
    with pytest.raises(ConfigError, match=r"unknown key 'optim.learning_rate' in .*mine.yaml"):
        load_config(str(recipe))


def test_semantic_checks():
    with pytest.raises(ConfigError, match="fsdp.param_dtype"):
        load_config("tiny_cpu", ["fsdp.param_dtype=float32"])
    with pytest.raises(ConfigError, match="data.micro_batch_size"):
        load_config("tiny_cpu", ["data.micro_batch_size=0"])
    with pytest.raises(ConfigError, match="'activation_checkpointing.mode: layers' needs"):
        load_config("tiny_cpu", ["activation_checkpointing.mode=layers"])
    with pytest.raises(ConfigError, match="'loss.chunk_tokens' must be at least 1, got 0"):
        load_config("tiny_cpu", ["loss.chunk_tokens=0"])


def test_checkpointing_policies_choose_layers():
    policy = load_config("tiny_cpu", ["activation_checkpointing.mode=first_last",
                                      "activation_checkpointing.first_last=2"]).activation_checkpointing
    assert [i for i in range(8) if policy.wraps(i, 8)] == [0, 1, 6, 7]
    policy = load_config("tiny_cpu", ["activation_checkpointing.mode=layers",
                                      "activation_checkpointing.layers=[1,4]"]).activation_checkpointing
    assert [i for i in range(8) if policy.wraps(i, 8)] == [1, 4] and policy.wrapped_count(8) == 2
    policy = load_config("tiny_cpu", ["activation_checkpointing.mode=every_nth",
                                      "activation_checkpointing.every_n=3"]).activation_checkpointing
    assert [i for i in range(8) if policy.wraps(i, 8)] == [0, 3, 6]


def test_collective_timeout_takes_fractions_of_a_minute_and_must_be_positive():
    assert load_config("tiny_cpu").train.collective_timeout_minutes == 60
    assert load_config("tiny_cpu", ["train.collective_timeout_minutes=0.5"]).train.collective_timeout_minutes == 0.5
    with pytest.raises(ConfigError, match="'train.collective_timeout_minutes' must be positive, got 0"):
        load_config("tiny_cpu", ["train.collective_timeout_minutes=0"])


def test_print_config_shows_the_resolved_values():
    result = run_train("--recipe", "tiny_cpu", "optim.lr=0.5", "--print-config")
    assert result.returncode == 0
    assert "lr: 0.5" in result.stdout and "cpu_offload: false" in result.stdout


def test_resume_flag_with_or_without_a_checkpoint():
    latest = run_train("--recipe", "tiny_cpu", "--resume", "optim.lr=0.5", "--print-config")  # an override follows
    assert latest.returncode == 0 and "resume: auto" in latest.stdout and "lr: 0.5" in latest.stdout
    given = run_train("--recipe", "tiny_cpu", "--resume-from", "runs/a/checkpoints/step-000100", "--print-config")
    assert given.returncode == 0 and "resume: runs/a/checkpoints/step-000100" in given.stdout
    old = run_train("--recipe", "tiny_cpu", "--resume", "runs/a/checkpoints/step-000100", "--print-config")
    assert old.returncode == 2 and old.stderr.strip() == (
        "error: 'runs/a/checkpoints/step-000100' is not a key=value override; to resume from a checkpoint folder, "
        "pass --resume-from runs/a/checkpoints/step-000100")


def test_every_shipped_recipe_loads():
    names = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert {"tiny_cpu", "llama70b_2x4090", "llama70b_2x3090", "llama3_8b_1x4090"} <= set(names)
    for name in names:
        cfg = load_config(name, [])
        assert cfg.hardware.gpu in GPUS, name
        if name == "tiny_cpu_dpo":  # shipped preference pairs, TRL's conversational shape
            assert (cfg.data.path, cfg.data.format, cfg.train.objective) == ("data/tiny_preferences.jsonl", "chat",
                                                                             "dpo")
        elif name == "tiny_cpu_kto":  # shipped unpaired records, TRL's shape
            assert (cfg.data.path, cfg.data.format, cfg.train.objective) == ("data/tiny_kto.jsonl", "chat", "kto")
        elif name == "tiny_cpu_grpo":  # shipped prompts, each with the column its reward function reads
            assert (cfg.data.path, cfg.data.format, cfg.train.objective) == ("data/tiny_prompts.jsonl", "prompt",
                                                                             "grpo")
            assert [r.function for r in cfg.grpo.rewards] == ["examples.rewards:category_words"]
        elif name == "tiny_cpu_tools_sft":  # make demo-tools' warm start: conversations calling the calculator
            assert (cfg.data.path, cfg.data.format, cfg.data.template) == ("data/tool_calls.jsonl", "chat", "chatml")
        elif name == "tiny_cpu_tools_grpo":  # make demo-tools: products to compute with the calculator
            assert (cfg.data.path, cfg.data.format, cfg.train.objective) == ("data/tool_prompts.jsonl", "prompt",
                                                                             "grpo")
            assert cfg.grpo.tools == ["examples/agent_tools.py:calculate"]
        elif name == "qwen2.5_vl_7b_1x24gb_grpo":  # TRL's vision GRPO set: a picture a problem, its solution
            assert [(s.path, s.format, s.fields) for s in cfg.data.sources] == [
                ("lmms-lab/multimodal-open-r1-8k-verified", "prompt", {"prompt": "problem", "answer": "solution"})]
            assert cfg.data.images_per_row == 1 and [r.function for r in cfg.grpo.rewards] == ["math_answer"]
        elif name == "tiny_cpu_rloo":  # tiny_cpu_grpo's prompts and reward, RLOO's update
            assert (cfg.data.path, cfg.train.objective) == ("data/tiny_prompts.jsonl", "rloo")
            assert [r.function for r in cfg.rloo.rewards] == ["examples.rewards:category_words"]
        elif name.endswith("_rloo"):  # GSM8K's questions as prompts, `answer` reaches math_answer
            assert [(s.path, s.fields) for s in cfg.data.sources] == [("openai/gsm8k", {"prompt": "question"})]
            assert cfg.train.objective == "rloo" and [r.function for r in cfg.rloo.rewards] == ["math_answer"]
        elif name.endswith(("_grpo", "_grpo_tools", "_grpo_long")):  # GSM8K's questions as prompts, `answer`
            # reaches math_answer
            assert [(s.path, s.subset, s.format, s.fields) for s in cfg.data.sources] == [
                ("openai/gsm8k", "main", "prompt", {"prompt": "question"})] and cfg.train.objective == "grpo"
            assert [r.function for r in cfg.grpo.rewards] == ["math_answer"]
            tools = ["examples/agent_tools.py:calculate"] if name.endswith("_tools") else []
            assert cfg.grpo.tools == tools, name
        elif name.endswith("_images"):  # TRL's LLaVA-Instruct mix: image parts in the messages, an `images` column
            assert [(s.path, s.format) for s in cfg.data.sources] == [("HuggingFaceH4/llava-instruct-mix-vsft", "chat")]
            assert cfg.data.images_per_row >= 1
        elif name.endswith("_dpo"):  # UltraFeedback-binarized's preference split, by hub id
            assert [(s.path, s.format, s.split) for s in cfg.data.sources] == [
                ("HuggingFaceH4/ultrafeedback_binarized", "chat", "train_prefs")] and cfg.train.objective == "dpo"
        elif name == "tiny_cpu_dft":  # tiny_cpu's shipped instructions, each token's loss weighted (DFT)
            assert (cfg.data.path, cfg.train.objective) == ("data/tiny_instruct.jsonl", "dft")
        elif name != "tiny_cpu":  # what Answer.AI trained on, by hub id (fetched at launch, never by a test or plan)
            assert (cfg.data.path, cfg.data.format, cfg.data.sources) == ("yahma/alpaca-cleaned", "alpaca", []), name


def test_yes_no_on_off_are_strings_where_strings_are_expected(tmp_path):
    """YAML 1.1 reads `off` as false; a recipe means the word where a key takes words, a boolean where it takes
    one. Quoted or not, in a file or an override."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("activation_checkpointing:\n  mode: off\ndata:\n  packing: yes\ntrain:\n  overwrite: On\n")
    read = read_yaml_text(recipe.read_text())  # the words as read, before the schema takes them
    assert [read[section][key] for section, key in (("activation_checkpointing", "mode"), ("data", "packing"),
                                                    ("train", "overwrite"))] == ["off", "yes", "On"]
    cfg = load_config(str(recipe))
    assert (cfg.activation_checkpointing.mode, cfg.data.packing, cfg.train.overwrite) == ("off", True, True)
    cfg = load_config("tiny_cpu", ["activation_checkpointing.mode=off", "data.packing=no", "train.output_dir=on"])
    assert (cfg.activation_checkpointing.mode, cfg.data.packing, cfg.train.output_dir) == ("off", False, "on")
    assert load_config("tiny_cpu", ["activation_checkpointing.mode='off'"]).activation_checkpointing.mode == "off"


def test_a_run_saved_before_a_value_was_renamed_still_loads(tmp_path):
    """`model.init: checkpoint` (now `pretrained`): refused in a recipe with the new name, read as the new name in
    the resolved config an older run saved with its adapter or checkpoint, and not reported as a changed setting."""
    saved = tmp_path / "training_config.yaml"
    text = to_yaml(load_config("tiny_cpu")).replace("init: pretrained", "init: checkpoint")
    saved.write_text(text)
    with pytest.raises(ConfigError, match="'model.init: checkpoint' is now 'model.init: pretrained'"):
        load_config(str(saved))
    assert load_config(str(saved), saved_by_a_run=True).model.init == "pretrained"
    assert changed_settings(text, load_config("tiny_cpu")) == []


def test_the_last_override_of_a_key_wins_in_one_place():
    """config/loader.py's one rule, which the studio's drafts, its data box and its run-folder finder all call."""
    from qlora_fsdp.config import last_override, merged_overrides
    from qlora_fsdp.readouts.data_preview import with_overrides_replaced
    from qlora_fsdp.studio.draft import Draft

    assert merged_overrides(["a=1", "b=2", "  "], ["a=3"]) == ["b=2", "a=3"]
    assert last_override(["x=1", "train.output_dir=a", " train.output_dir = b"], "train.output_dir") == "b"
    assert last_override(["x=1"], "train.output_dir") is None
    assert Draft("tiny_cpu", ("a=1", "b=2")).with_overrides(["a=3"]).overrides == ("b=2", "a=3")
    assert with_overrides_replaced("a=1\n\nb=2", ["a=3"]) == "b=2\na=3"
