"""A corpus of bad inputs, as users write them: each ends train.py with one `error:` line naming the file or key
and the fix, exit code 2, no traceback, and the output folder as it was.

Run in-process through the command line's own entry point (qlora_fsdp.commands.train.main, which train.py exits
with), so forty cases cost seconds, not forty interpreter starts. What torchrun adds on top is
tests/test_rank_errors.py.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from qlora_fsdp.commands.train import main
from tests.helpers import REPO

Setup = Callable[[Path, Path], list[str]]  # (this case's folder, the tiny model) -> extra train.py arguments
PROGRESS_BAR = re.compile(r"\| \d+/\d+ \[|\d+ examples \[")  # tqdm's, from datasets and the shard writer
GOOD_RECORDS = (REPO / "data" / "tiny_instruct.jsonl").read_text().splitlines()[:40]


@dataclass(frozen=True)
class BadInput:
    name: str
    expected: str  # a regular expression the error line must match (after "error: ")
    setup: Setup  # its docstring: the situation, as a user would say it (docs/troubleshooting.md shows it)
    fix: str = ""  # what to do, where the error line does not say it (docs/troubleshooting.md shows it)

    @property
    def situation(self) -> str:
        return " ".join((self.setup.__doc__ or "").split())


CASES: list[BadInput] = []


def bad_input(expected: str, fix: str = "") -> Callable[[Setup], Setup]:
    def register(setup: Setup) -> Setup:
        CASES.append(BadInput(setup.__name__, expected, setup, fix))
        return setup
    return register


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def data_file(d: Path, lines: list[str], name: str = "data.jsonl") -> str:
    text = "".join(line + "\n" for line in lines)
    return f"data.path={write(d / name, text)}"


def recipe(d: Path, text: str | bytes) -> list[str]:
    return ["--recipe", str(write(d / "recipe.yaml", text))]


def fake_run_folder(d: Path, state: str, world_size: int = 1) -> Path:
    """An earlier run's folder with one checkpoint whose trainer_state.json is `state` (or valid JSON)."""
    out = d / "run"
    write(out / "metrics.jsonl", json.dumps({"step": 1, "loss": 1.0}) + "\n")
    write(out / "checkpoints" / "step-000002" / "trainer_state.json",
          state or json.dumps({"step": 2, "world_size": world_size}))
    return out


# --- recipes ---------------------------------------------------------------------------------------------------
@bad_input(r"recipe\.yaml: not UTF-8 text \(byte \d+\); save the recipe as UTF-8")
def recipe_not_utf8(d: Path, model: Path) -> list[str]:
    """A recipe saved in Latin-1 (an accented comment) instead of UTF-8."""
    return recipe(d, "# r\xe9glages\noptim:\n  lr: 1.0e-4\n".encode("latin-1"))


@bad_input(r"recipe\.yaml:3: not valid YAML",
           fix="indent every key of a section by the same number of spaces (YAML reads indentation as structure); the "
               "line number is where the parser noticed, the slip may be just above.")
def recipe_bad_indentation(d: Path, model: Path) -> list[str]:
    """A recipe with a key indented one space less than its neighbours."""
    return recipe(d, "optim:\n  lr: 1.0e-4\n warmup_steps: 3\n")


@bad_input(r"recipe\.yaml: expected a mapping of keys at the top level",
           fix="write the recipe as sections of `key: value` lines, as in recipes/.")
def recipe_is_a_list(d: Path, model: Path) -> list[str]:
    """A recipe written as a YAML list instead of `key: value` mappings."""
    return recipe(d, "- optim\n- lr\n")


@bad_input(r"recipe\.yaml: the file is empty \(or only comments\)")
def recipe_empty(d: Path, model: Path) -> list[str]:
    """An empty recipe file."""
    return recipe(d, "")


@bad_input(r"recipe\.yaml: the file is empty \(or only comments\)")
def recipe_only_comments(d: Path, model: Path) -> list[str]:
    """A recipe whose every line is commented out."""
    return recipe(d, "# llama70b_2x4090: 70B on two RTX 4090s\n#\n# model:\n#   path: meta-llama/Llama-3.1-70B\n")


@bad_input(r"unknown key 'optim\.lrr' in .*recipe\.yaml; did you mean 'optim\.lr'\?")
def recipe_key_typo(d: Path, model: Path) -> list[str]:
    """A misspelt key in a recipe (`optim.lrr`)."""
    return recipe(d, "optim:\n  lrr: 1.0e-4\n")


@bad_input(r"'optim\.lr' must be a number, got 'fast'",
           fix="give the key a value of its type (docs/config-reference.md lists each key's).")
def recipe_wrong_type(d: Path, model: Path) -> list[str]:
    """A recipe value of the wrong type (a word where a number goes)."""
    return recipe(d, "optim:\n  lr: fast\n")


@bad_input(r"unknown recipe 'tiny_cpuu': did you mean 'tiny_cpu'\?")
def recipe_name_typo(d: Path, model: Path) -> list[str]:
    """A misspelt recipe name after `--recipe`."""
    return ["--recipe", "tiny_cpuu"]


@bad_input(r"recipe file not found: .*missing\.yaml",
           fix="check the path; a shipped recipe is named without folder or extension (`--recipe tiny_cpu`).")
def recipe_file_missing(d: Path, model: Path) -> list[str]:
    """`--recipe` naming a YAML file that does not exist."""
    return ["--recipe", str(d / "missing.yaml")]


@bad_input(r"'checkpointing\.mode' in .*recipe\.yaml is now 'activation_checkpointing\.mode'")
def recipe_old_key(d: Path, model: Path) -> list[str]:
    """A recipe using a key's old name (`checkpointing:`)."""
    return recipe(d, "checkpointing:\n  mode: off\n")


# --- overrides -------------------------------------------------------------------------------------------------
@bad_input(r"override 'optim\.lr' is not of the form key=value")
def override_without_value(d: Path, model: Path) -> list[str]:
    """An override without `=value`."""
    return ["optim.lr"]


@bad_input(r"unknown key 'data\.micro_batch' .*did you mean 'data\.micro_batch_size'\?")
def override_key_typo(d: Path, model: Path) -> list[str]:
    """A misspelt key in a command-line override."""
    return ["data.micro_batch=4"]


@bad_input(r"'activation_checkpointing\.mode' must be one of .*got 'offf'")
def override_bad_choice(d: Path, model: Path) -> list[str]:
    """An override whose value is not one of the key's choices."""
    return ["activation_checkpointing.mode=offf"]


@bad_input(r"unknown fsdp_preset 'shard_everything': choose one of")
def override_unknown_preset(d: Path, model: Path) -> list[str]:
    """An `fsdp_preset` that has no file in fsdp_configs/."""
    return ["fsdp_preset=shard_everything"]


@bad_input(r"'data\.format' must be one of .*got 'xml'")
def override_unknown_format(d: Path, model: Path) -> list[str]:
    """A data format the loader does not read (`data.format=xml`)."""
    return ["data.format=xml"]


@bad_input(r"'optim\.warmup_ratio' must be at least 0 and below 1",
           fix="give a fraction of the run below 1 (0.03: the first 3% of the steps), or a number of steps as "
               "`optim.warmup_steps`.")
def override_warmup_ratio_too_large(d: Path, model: Path) -> list[str]:
    """A warmup ratio of 1 or more."""
    return ["optim.warmup_ratio=1.5"]


@bad_input(r"'optim\.warmup_steps: 5' and 'optim\.warmup_ratio: 0\.1' are both set")
def override_two_warmups(d: Path, model: Path) -> list[str]:
    """Both a warmup in steps and a warmup ratio set."""
    return ["optim.warmup_steps=5", "optim.warmup_ratio=0.1"]


@bad_input(r"'data\.packing' must be true or false, got 'maybe'",
           fix="write `true` or `false`.")
def override_boolean_word(d: Path, model: Path) -> list[str]:
    """A boolean key given a word that is not true or false."""
    return ["data.packing=maybe"]


@bad_input(r"'.*' is not a key=value override; to resume from a checkpoint folder, pass --resume-from")
def override_old_resume_spelling(d: Path, model: Path) -> list[str]:
    """A checkpoint folder passed as a bare argument, the old way to resume."""
    (d / "ckpt").mkdir()
    return [str(d / "ckpt")]


# --- data files ------------------------------------------------------------------------------------------------
@bad_input(r"data source .*nothere\.jsonl does not exist",
           fix="check `data.path`: a JSON/JSONL/Parquet/CSV file, a folder of them, or a hub dataset id.")
def data_missing(d: Path, model: Path) -> list[str]:
    """`data.path` naming a file that does not exist."""
    return [f"data.path={d / 'nothere.jsonl'}"]


@bad_input(r"data\.jsonl:41: not valid JSON",
           fix="complete or remove that line; each line of a JSON-lines file is one whole JSON object (a cut-off last "
               "line: the file was not copied or written to the end).")
def data_truncated_last_line(d: Path, model: Path) -> list[str]:
    """A JSON-lines data file whose last line was cut off."""
    return [data_file(d, [*GOOD_RECORDS, '{"instruction": "Count the words.", "output": "th'])]


@bad_input(r"data\.jsonl:3: a record must be a JSON object, got list",
           fix="make every line a JSON object with the format's fields (alpaca: instruction, input, output).")
def data_record_not_an_object(d: Path, model: Path) -> list[str]:
    """A JSON-lines record that is a list, not an object."""
    return [data_file(d, [*GOOD_RECORDS[:2], '["instruction", "output"]', *GOOD_RECORDS[2:]])]


@bad_input(r"data\.jsonl: record 41 lacks the text field 'output'",
           fix="add the field to that record or drop the record; if your data names it otherwise, map it with "
               "`data.fields` (`data.fields={output: response}`).")
def data_missing_field(d: Path, model: Path) -> list[str]:
    """An alpaca record without its `output` field."""
    return [data_file(d, [*GOOD_RECORDS, '{"instruction": "Say hi.", "input": ""}'])]


@bad_input(r"chat\.jsonl: record 1 has a turn without a known 'role'",
           fix="give every turn a role (system, user, assistant or tool; ShareGPT's human, gpt, observation too) and "
               "a text `content`.")
def data_unknown_role(d: Path, model: Path) -> list[str]:
    """A chat turn whose role is not system, user, assistant or tool."""
    turns = [{"role": "narrator", "content": "Once"}, {"role": "assistant", "content": "upon"}]
    return [data_file(d, [json.dumps({"messages": turns})], "chat.jsonl"), "data.format=chat"]


@bad_input(r"chat\.jsonl: record 2 lacks the list of turns 'messages' \(got str: 'Hello, who are you\?'\)",
           fix="give `messages` a list of {role, content} turns; a plain string is not a conversation.")
def data_messages_a_string(d: Path, model: Path) -> list[str]:
    """A chat record whose `messages` is a string, not a list of turns."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    return [data_file(d, [json.dumps({"messages": turns}), json.dumps({"messages": "Hello, who are you?"})],
                      "chat.jsonl"), "data.format=chat"]


@bad_input(r"chat\.jsonl: record 1 has no assistant turn to learn from",
           fix="add the assistant's reply or drop the record: the loss is taken on assistant turns.")
def data_no_assistant_turn(d: Path, model: Path) -> list[str]:
    """A chat with no assistant turn."""
    return [data_file(d, [json.dumps({"messages": [{"role": "user", "content": "hi"}]})], "chat.jsonl"),
            "data.format=chat"]


@bad_input(r"data\.txt: unsupported data file type; use one of \.json, \.jsonl, \.parquet, \.csv",
           fix="convert the file to one of those; plain text goes in a .jsonl of `{\"text\": ...}` records with "
               "`data.format=text`.")
def data_unsupported_extension(d: Path, model: Path) -> list[str]:
    """A data file of a type the loader does not read (`.txt`)."""
    return [f"data.path={write(d / 'data.txt', 'hello')}"]


@bad_input(r"empty_folder holds no data files",
           fix="point `data.path` at the folder that holds the data files, or at one file.")
def data_empty_folder(d: Path, model: Path) -> list[str]:
    """`data.path` naming a folder with no data files in it."""
    (d / "empty_folder").mkdir()
    return [f"data.path={d / 'empty_folder'}"]


@bad_input(r"data fields \['question'\] do not apply to format 'alpaca'",
           fix="map our field names (the keys) to your data's names (the values), e.g. `data.fields={instruction: "
               "question}`.")
def data_unknown_field_name(d: Path, model: Path) -> list[str]:
    """A `data.fields` mapping that names a field the format does not have."""
    return [data_file(d, GOOD_RECORDS), "data.fields={question: q}"]


@bad_input(r"no trainable samples in .*data\.jsonl after fitting to 8 tokens",
           fix="raise `data.context_length`, or keep long samples with `data.overlong=truncate` (or `split`).")
def data_every_sample_too_long(d: Path, model: Path) -> list[str]:
    """Every sample longer than the context, with overlong samples dropped."""
    return [data_file(d, GOOD_RECORDS), "data.context_length=8", "data.overlong=drop"]


@bad_input(r"data\.csv: record 1 lacks the text field 'instruction'",
           fix="name the columns after the format's fields, or map them: `data.fields={instruction: question, output: "
               "answer}`.")
def data_csv_wrong_columns(d: Path, model: Path) -> list[str]:
    """A CSV file whose columns are not the format's fields."""
    csv = write(d / "data.csv", "question,answer\nWhat?,That.\n")
    return [f"data.path={csv}"]


@bad_input(r"tools\.jsonl: record 1 has a tool call that is not a JSON \{name, arguments\} object",
           fix="write the call's value as a JSON object `{\"name\": ..., \"arguments\": {...}}`.")
def data_bad_function_call(d: Path, model: Path) -> list[str]:
    """A ShareGPT function call whose value is not valid JSON."""
    turns = [{"from": "human", "value": "Weather in Oslo?"}, {"from": "function_call", "value": "{not json"},
             {"from": "observation", "value": "{}"}, {"from": "gpt", "value": "Sunny."}]
    return [data_file(d, [json.dumps({"conversations": turns})], "tools.jsonl"), "data.format=sharegpt"]


# --- GRPO prompts and rewards ----------------------------------------------------------------------------------
@bad_input(r"gsm8k\.jsonl: GRPO reads a 'prompt' column \(or data\.fields: \{prompt: <column>\}\); the records have "
           r"\['question', 'answer'\]")
def grpo_data_without_prompt_column(d: Path, model: Path) -> list[str]:
    """GSM8K's records for GRPO, whose prompts are in a `question` column."""
    record = json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"})
    return ["--recipe", "tiny_cpu_grpo", data_file(d, [record] * 8, "gsm8k.jsonl")]


@bad_input(r"prompts\.jsonl record 2: the prompt has \d+ tokens, more than data\.context_length - "
           r"generation\.max_completion_length = 24; raise data\.context_length or shorten it")
def grpo_prompt_longer_than_the_context(d: Path, model: Path) -> list[str]:
    """A GRPO prompt that leaves no room in the context for its completion."""
    lines = [json.dumps({"prompt": "Name a colour." if i != 1 else "Name a colour. " * 40, "category": "colors"})
             for i in range(8)]
    return ["--recipe", "tiny_cpu_grpo", data_file(d, lines, "prompts.jsonl")]


@bad_input(r"reward function 'my_rewards:correct': cannot import my_rewards")
def grpo_unknown_reward_function(d: Path, model: Path) -> list[str]:
    """A reward function whose module does not exist (refused before the model, here a missing folder, is read)."""
    return ["--recipe", "tiny_cpu_grpo", "grpo.rewards=[{function: my_rewards:correct}]", "model.path=/nonexistent"]


@bad_input(r"'train\.objective: grpo' needs reward functions: grpo\.rewards: \[\{function: math_answer\}\]")
def grpo_without_rewards(d: Path, model: Path) -> list[str]:
    """A GRPO run with no reward function."""
    return ["--recipe", "tiny_cpu_grpo", "grpo.rewards=[]"]


@bad_input(r"reward function reward_model: .*sft_adapter is not a reward model's adapter \(its task_type is not "
           r"SEQ_CLS\); train one with train\.objective: reward")
def grpo_reward_model_that_is_an_sft_adapter(d: Path, model: Path) -> list[str]:
    """A GRPO reward model option pointing at an SFT run's adapter instead of a reward model's."""
    folder = d / "sft_adapter"
    write(folder / "adapter_config.json", json.dumps({"task_type": "CAUSAL_LM"}))
    write(folder / "training_config.yaml", "model:\n  path: models/tiny-llama\n")
    return ["--recipe", "tiny_cpu_grpo", f"grpo.rewards=[{{function: reward_model, options: {{adapter: {folder}}}}}]"]


# --- the options peers offer: LoRA+, NEFTune, KTO, reward models --------------------------------------------------
@bad_input(r"'lora\.plus_ratio' must be positive \(LoRA\+ suggests 16\), or null for one learning rate, got -16")
def loraplus_ratio_negative(d: Path, model: Path) -> list[str]:
    """LoRA+ with a negative ratio (a sign typed by mistake)."""
    return ["lora.plus_ratio=-16"]


@bad_input(r"'lora\.init' must be one of default, pissa, olora, loftq, eva or pissa_niter_<iterations> \(e\.g\. "
           r"pissa_niter_4\), got 'svd'")
def lora_init_unknown(d: Path, model: Path) -> list[str]:
    """An init name PEFT does not have (svd instead of pissa)."""
    return ["lora.init=svd"]


@bad_input(r"'lora\.init: pissa' with lora\.use_dora: that start is not built for it yet; use lora\.init: default, or "
           r"leave out lora\.use_dora")
def lora_init_pissa_with_dora(d: Path, model: Path) -> list[str]:
    """PiSSA's start asked for together with DoRA."""
    return ["lora.init=pissa", "lora.use_dora=true"]


@bad_input(r"'model\.add_tokens' adds rows to the embeddings and the head that nothing would train; set "
           r"lora\.train_embeddings: true")
def new_tokens_without_training_the_embeddings(d: Path, model: Path) -> list[str]:
    """New tokens added to the tokenizer while the embeddings stay frozen."""
    return ["model.add_tokens=[<think>]"]


@bad_input(r"'train\.neftune_alpha' with train\.objective grpo: .*; remove train\.neftune_alpha")
def neftune_with_grpo(d: Path, model: Path) -> list[str]:
    """NEFTune's noise asked for in a GRPO run."""
    return ["--recipe", "tiny_cpu_grpo", "train.neftune_alpha=5"]


@bad_input(r"kto\.jsonl: record 2: its label is 'yes'; KTO's label is true \(desirable\) or false \(undesirable\)")
def kto_record_with_a_word_for_its_label(d: Path, model: Path) -> list[str]:
    """A KTO record whose label is the word "yes" instead of true."""
    good = {"prompt": "Say one.", "completion": "One.", "label": True}
    lines = [json.dumps(good), json.dumps({**good, "label": "yes"})] + [json.dumps(good)] * 6
    return ["--recipe", "tiny_cpu_kto", data_file(d, lines, "kto.jsonl")]


@bad_input(r"'train\.objective: kto' reads records of a prompt, a completion and a label \('data\.format: chat'\), "
           r"got format alpaca")
def kto_with_alpaca_records(d: Path, model: Path) -> list[str]:
    """KTO asked for on alpaca-format records."""
    return ["train.objective=kto"]


@bad_input(r"pairs\.jsonl: record 1: its margin is 'large'; a margin is a number \(or set preference\.bad_pairs: "
           r"drop\)")
def reward_pair_with_a_word_for_its_margin(d: Path, model: Path) -> list[str]:
    """A reward model's preference pair whose margin is a word."""
    pair = json.loads((REPO / "data" / "tiny_preferences.jsonl").read_text().splitlines()[0])
    return ["--recipe", "tiny_cpu_dpo", "train.objective=reward",
            data_file(d, [json.dumps({**pair, "margin": "large"})] * 8, "pairs.jsonl")]


# --- records with images --------------------------------------------------------------------------------------
@bad_input(r"the data's records show images, but .* is a llama checkpoint without a vision tower; use a "
           r"vision-language checkpoint, or text-only records")
def data_images_for_a_text_model(d: Path, model: Path) -> list[str]:
    """Chat records with images for a text-only checkpoint."""
    record = {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                                        {"type": "text", "text": "What is it?"}]},
                           {"role": "assistant", "content": "A cat."}]}
    return [data_file(d, [json.dumps(record)] * 4, "images.jsonl"), "data.format=chat"]


@bad_input(r"lora\.train_projector / lora\.target_vision_tower train a vision-language checkpoint's image side: the "
           r"data's records show no images \(image parts, or an `images` column\)")
def lora_train_projector_without_images(d: Path, model: Path) -> list[str]:
    """The projector trained (lora.train_projector) on text-only records."""
    return ["lora.train_projector=true"]


@bad_input(r"'data\.image_min_pixels' \(1003520\) and 'data\.image_max_pixels' \(3136\) must be positive, min at "
           r"most max")
def data_pixel_budget_upside_down(d: Path, model: Path) -> list[str]:
    """A pixel budget whose least is more than its most (the two keys swapped)."""
    return ["data.image_min_pixels=1003520", "data.image_max_pixels=3136"]


@bad_input(r"'fsdp\.context_parallel: 2' needs 2 ranks: launch with torchrun --nproc_per_node 2")
def context_parallel_without_the_ranks(d: Path, model: Path) -> list[str]:
    """Rows split over two GPUs, launched as one process (plain python instead of torchrun)."""
    return ["fsdp.context_parallel=2"]


@bad_input(r"'fsdp\.context_parallel: 2' with GRPO's tools or environments: multi-turn rollouts across a split are "
           r"not built yet; use fsdp\.context_parallel: 1")
def context_parallel_with_grpo_tools(d: Path, model: Path) -> list[str]:
    """Rows split over two GPUs for GRPO with tool calls."""
    return ["--recipe", "tiny_cpu_tools_grpo", "fsdp.context_parallel=2"]


# --- model folders ---------------------------------------------------------------------------------------------
@bad_input(r"no_config has no config\.json: not a Hugging Face checkpoint folder")
def model_without_config(d: Path, model: Path) -> list[str]:
    """A model folder without its config.json."""
    folder = shutil.copytree(model, d / "no_config")
    (folder / "config.json").unlink()
    return [f"model.path={folder}"]


@bad_input(r"model\.path '\./nowhere/model' is not a checkpoint folder",
           fix="point `model.path` at a folder holding config.json, the tokenizer and the weights (or a hub id, with "
               "network access).")
def model_path_missing(d: Path, model: Path) -> list[str]:
    """`model.path` naming a folder that does not exist (and no hub access)."""
    return ["model.path=./nowhere/model"]


@bad_input(r"no_tokenizer: cannot load its tokenizer .*tokenizer\.json")
def model_without_tokenizer(d: Path, model: Path) -> list[str]:
    """A model folder without its tokenizer files."""
    folder = d / "no_tokenizer"
    folder.mkdir()
    shutil.copy(model / "config.json", folder)
    return [f"model.path={folder}"]


@bad_input(r"broken_config/config\.json: not valid JSON \(Expecting value: line 1",
           fix="download the checkpoint's config.json again.")
def model_config_not_json(d: Path, model: Path) -> list[str]:
    """A model's config.json cut off mid-file."""
    folder = shutil.copytree(model, d / "broken_config")
    write(folder / "config.json", '{"model_type": "llama", "hidden_size": ')
    return [f"model.path={folder}"]


def quantized_copy(d: Path, model: Path, quantization: dict) -> str:
    """The model with config.json saying its weights are stored in another form (as such hub repos say it)."""
    folder = shutil.copytree(model, d / "quantized")
    config = json.loads((folder / "config.json").read_text())
    write(folder / "config.json", json.dumps({**config, "quantization_config": quantization}))
    return f"model.path={folder}"


@bad_input(r"quantized/config\.json says its weights are stored in 8-bit bitsandbytes .*: use the unquantized "
           r"checkpoint or a bitsandbytes 4-bit \(NF4\) one")
def model_stored_in_8bit(d: Path, model: Path) -> list[str]:
    """A checkpoint stored in bitsandbytes 8-bit."""
    return [quantized_copy(d, model, {"quant_method": "bitsandbytes", "load_in_8bit": True})]


@bad_input(r"says its weights are stored in GPTQ \(quantization_config\.quant_method 'gptq'\)")
def model_stored_in_gptq(d: Path, model: Path) -> list[str]:
    """A checkpoint stored in GPTQ."""
    return [quantized_copy(d, model, {"quant_method": "gptq", "bits": 4, "group_size": 128})]


@bad_input(r"says its weights are stored in AWQ \(quantization_config\.quant_method 'awq'\)")
def model_stored_in_awq(d: Path, model: Path) -> list[str]:
    """A checkpoint stored in AWQ."""
    return [quantized_copy(d, model, {"quant_method": "awq", "bits": 4, "version": "gemm"})]


@bad_input(r"says its weights are stored in FP8 \(quantization_config\.quant_method 'fp8'\)")
def model_stored_in_fp8(d: Path, model: Path) -> list[str]:
    """A checkpoint stored in FP8."""
    return [quantized_copy(d, model, {"quant_method": "fp8", "weight_block_size": [128, 128]})]


@bad_input(r"llama: config\.json says its weights are stored in MXFP4 and it has no experts: MXFP4 dense weights "
           r"are not supported")
def model_stored_in_mxfp4_dense(d: Path, model: Path) -> list[str]:
    """A dense (not mixture-of-experts) checkpoint stored in MXFP4."""
    return [quantized_copy(d, model, {"quant_method": "mxfp4"})]


@bad_input(r"holds bitsandbytes 4-bit weights quantized with quant\.double_quant=false, which the recipe's "
           r"quant\.double_quant=true contradicts: add quant\.double_quant=false")
def recipe_contradicts_a_prequantized_checkpoint(d: Path, model: Path) -> list[str]:
    """A 4-bit checkpoint quantized without double quantization, trained with the default `quant.double_quant: true`."""
    return [quantized_copy(d, model, {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                      "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False})]


@bad_input(r"the 4-bit weight 'model\.layers\.0\..*\.weight' was quantized with blocksize 64: add quant\.blocksize=64")
def recipe_blocksize_contradicts_a_prequantized_checkpoint(d: Path, model: Path) -> list[str]:
    """A 4-bit checkpoint quantized with another block size than the recipe's `quant.blocksize`."""
    from tests.test_prequantized import prequantize

    return [f"model.path={prequantize(model, d / 'bnb-4bit', torch.uint8)}", "quant.blocksize=128"]


@bad_input(r"checkpoint holds only some of the statistics of the 4-bit weight 'model\.layers\.0\.self_attn\.q_proj"
           r"\.weight': damaged or incomplete download\?",
           fix="download the checkpoint again.")
def prequantized_checkpoint_missing_a_statistic(d: Path, model: Path) -> list[str]:
    """A 4-bit checkpoint missing one of a weight's quantization statistics (a damaged download)."""
    from safetensors.torch import load_file, save_file

    from tests.test_prequantized import prequantize

    folder = prequantize(model, d / "bnb-4bit", torch.uint8)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight.absmax"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return [f"model.path={folder}"]


@bad_input(r"lora\.target_modules \['query', 'value'\] names no linear layer of this model; its linear layers are "
           r"\[.*'q_proj'.*\]")
def lora_targets_nothing(d: Path, model: Path) -> list[str]:
    """`lora.target_modules` naming layers the model does not have."""
    return ["lora.target_modules=[query, value]"]


@bad_input(r"lora\.target_experts: true, but this model is not a mixture of experts; remove it")
def expert_lora_on_a_dense_model(d: Path, model: Path) -> list[str]:
    """`lora.target_experts: true` on a model without experts."""
    return ["lora.target_experts=true"]


@bad_input(r"'preference\.reference: adapter_off' would compare against the trained routers")
def dpo_reference_with_trained_routers(d: Path, model: Path) -> list[str]:
    """DPO with trained routers and the reference taken with the adapter off."""
    return ["train.objective=dpo", "lora.train_router=true", "preference.reference=adapter_off"]


# --- checkpoints and run folders -------------------------------------------------------------------------------
@bad_input(r"trainer_state\.json is damaged \(.*\): checkpoint step-000002 cannot be resumed; no earlier checkpoint")
def checkpoint_state_not_json(d: Path, model: Path) -> list[str]:
    """Resuming from a checkpoint whose trainer_state.json was cut off."""
    fake_run_folder(d, '{"step": 2, "world_si')
    return ["--resume"]


@bad_input(r"trainer_state\.json is damaged \(it lacks 'step' or 'world_size'\)")
def checkpoint_state_without_step(d: Path, model: Path) -> list[str]:
    """Resuming from a checkpoint whose trainer_state.json lacks its step."""
    fake_run_folder(d, json.dumps({"world_size": 1}))
    return ["--resume"]


@bad_input(r"checkpoint .*step-000002 was written by 4 ranks and this run has 1")
def checkpoint_other_world_size(d: Path, model: Path) -> list[str]:
    """Resuming on 1 rank a checkpoint written by 4."""
    fake_run_folder(d, "", world_size=4)
    return ["--resume"]


@bad_input(r"train\.resume=.*not_a_checkpoint is not a complete checkpoint \(no trainer_state\.json\)")
def checkpoint_folder_not_a_checkpoint(d: Path, model: Path) -> list[str]:
    """`--resume-from` naming a folder that is not a checkpoint."""
    (d / "not_a_checkpoint").mkdir()
    return ["--resume-from", str(d / "not_a_checkpoint")]


@bad_input(r"output folder .*run already holds a run \(latest checkpoint step-000002\); resume it with --resume")
def run_folder_holds_a_run(d: Path, model: Path) -> list[str]:
    """Starting a run in the output folder of an earlier run, without `--resume`."""
    fake_run_folder(d, "")
    return []


@bad_input(r"output folder .*run already exists and is not empty")
def run_folder_holds_other_files(d: Path, model: Path) -> list[str]:
    """Starting a run in an output folder that holds other files."""
    write(d / "run" / "notes.txt", "mine")
    return []


@bad_input(r"train\.output_dir .*run is a file, not a folder")
def run_folder_is_a_file(d: Path, model: Path) -> list[str]:
    """`train.output_dir` naming a file."""
    write(d / "run", "a file where the run folder should go")
    return []


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (or the file itself): its bytes, None for a folder."""
    if folder.is_file():
        return {".": folder.read_bytes()}
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in folder.rglob("*")}


def split_arguments(extra: list[str]) -> tuple[list[str], list[str]]:
    """(flags with their values, key=value overrides): flags go first, the case's overrides after the base ones."""
    flags, overrides, tokens = [], [], iter(extra)
    for token in tokens:
        if token in ("--recipe", "--resume-from"):
            flags += [token, next(tokens)]
        elif token.startswith("--"):
            flags.append(token)
        else:
            overrides.append(token)
    return flags, overrides


def train_argv(extra: list[str], out: Path, model: Path) -> list[str]:
    """train.py's arguments for a case: the tiny recipe unless the case names one, the case's flags, the base
    overrides (the tiny model, a short run into `out`), then the case's own overrides."""
    flags, overrides = split_arguments(extra)
    base = [f"model.path={model}", "data.eval_samples=4", "train.max_steps=2", f"train.output_dir={out}"]
    return [*([] if "--recipe" in flags else ["--recipe", "tiny_cpu"]), *flags, *base, *overrides]


def test_the_corpus_is_large():
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_touched(case, tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "run"
    extra = case.setup(tmp_path, tiny_model_dir)
    before = snapshot(out) if out.exists() else None
    code = main(train_argv(extra, out, tiny_model_dir))
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, captured.err[-3000:]
    assert re.search(case.expected, errors[0].removeprefix("error: ")), errors[0]
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    noise = [line for line in captured.err.splitlines() if line.strip() and not line.startswith("error: ")
             and not PROGRESS_BAR.search(line)]
    assert not noise, noise  # nothing but the line (progress bars aside)
    if before is None:  # a fresh run: nothing written (an empty folder at most)
        assert not out.exists() or not any(out.iterdir())
    else:
        assert snapshot(out) == before
