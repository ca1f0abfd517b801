"""The support matrix: every decoder-only causal LM of transformers' MODEL_FOR_CAUSAL_LM_MAPPING, built from a tiny
config (tests/families.py's sizes), loaded by our code at world size 1 and held to transformers + bitsandbytes NF4.

`python -m tests.support_matrix [model_type ...]` (make support-matrix: all, about 8 minutes on 2 cores; named
ones re-run into the record; `--defaults`: the defaults alone, after CHECKED_FAMILIES changed) writes
tests/fixtures/support_matrix.json and the generated table of docs/model-families.md; it exits non-zero if any
family differs silently or ends in a traceback. tests/test_support_matrix.py holds the record to the installed
transformers (every family of its mapping is in it) and the docs table to the record, and re-runs one family.

Per family, what it does past the gate (`model.unchecked_family=true`), one of:
- exact: the held-out loss of a few samples equals the reference's (rel 1e-4, fp32);
- refused: our load stops in one line (a UserError) that names what is missing;
- differs / failed: a different loss, or any other exception (a traceback);
- not built: transformers itself cannot build, save or load the tiny model in NF4 (or it is not decoder-only):
  nothing of ours is judged.
and what a user gets by default: the same for a family in qlora_fsdp.families.CHECKED_FAMILIES, the gate's one-line
refusal for another. A family whose default is differs or failed fails the matrix (and the test).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "tests" / "fixtures" / "support_matrix.json"
DOCS = REPO / "docs" / "model-families.md"
BEGIN, END = "<!-- support-matrix: begin (make support-matrix) -->", "<!-- support-matrix: end -->"
JUDGED_FAILURES = ("differs", "failed")
TIMEOUT_S = 240
MEMORY_GIB = 6  # two children at a time on a 24 GB machine
N_SAMPLES = 4


def causal_lm_families() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


def tiny_model(model_type: str, out: Path) -> Path:
    """The family's tiny model (tests/families.py's sizes and tokenizer), saved fp32, or an exception."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qlora_fsdp.families import full_model_class
    from qlora_fsdp.tools.tiny_model import train_tokenizer
    from tests.families import FAMILIES, MOE_FAMILIES, SMALL, _tokens

    tokenizer = train_tokenizer(REPO / "data" / "tiny_instruct.jsonl", 512)
    if model_type == "mllama":  # its defaults' vision tower is large: tests/test_vision.py's tiny one
        from tests.vision_models import write_tiny_mllama

        return write_tiny_mllama(out, tokenizer)
    # tests/test_families.py's own config where it has one (MLA's ranks, Llama 4's layer kinds and its multimodal
    # checkpoint): the family's defaults do not all fit hidden size 64
    builders = {**FAMILIES, **MOE_FAMILIES}.values()
    known = {config.model_type: config for config in (build(tokenizer) for build in builders)}
    if model_type == "gemma4":  # the multimodal checkpoint Gemma 4 ships: the tiny text model, a tiny vision tower
        known["gemma4"] = tiny_gemma4_multimodal(known["gemma4_text"], tokenizer)
    config = known.get(model_type) or AutoConfig.for_model(model_type, **{**SMALL, **_tokens(tokenizer)})
    if getattr(config, "is_encoder_decoder", False):
        raise NotDecoderOnly("an encoder-decoder config")
    torch.manual_seed(0)
    # a config that names its architecture (Llama 4's multimodal one) is built as that class, as the hub stores it
    model = full_model_class(config)(config) if config.architectures else AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # nonzero biases, as tests/families.py makes them
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_gemma4_multimodal(text: Any, tokenizer: Any) -> Any:
    """Gemma4ForConditionalGeneration as the hub's 26B-A4B and 31B are stored (its defaults' towers are large)."""
    from transformers import Gemma4Config, Gemma4VisionConfig

    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16)
    image, begin, end = tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=None, boi_token_id=begin,
                        eoi_token_id=end, image_token_id=image, video_token_id=image, boa_token_id=begin,
                        eoa_token_index=end, audio_token_id=image)


class NotDecoderOnly(Exception):
    pass


def reference_loss_of(model_dir: Path, samples: list) -> float:
    import torch

    from tests.test_families import reference_model

    model = reference_model(model_dir)
    n_targets = sum(sum(label != -100 for label in s.labels[1:]) for s in samples)
    total = 0.0
    with torch.no_grad():
        for sample in samples:
            logits = model(input_ids=torch.tensor([sample.input_ids])).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(sample.labels[1:]),
                                                             ignore_index=-100, reduction="sum"))
    return total / n_targets


def our_loss(model_dir: Path, samples: list, out: Path) -> float:
    import torch

    from qlora_fsdp.data.batching import collate
    from qlora_fsdp.distributed import init_distributed
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.losses.forward import ForwardLoss
    from tests.helpers import tiny_config

    cfg = tiny_config(model_dir, train={"output_dir": str(out)}, lora={"r": 4, "dropout": 0.0},
                      model={"unchecked_family": True})  # what the family does past the gate
    info = init_distributed()
    model = build_sharded_model(cfg, info).eval()  # no dropout: the reference is in eval mode
    n_targets = sum(sum(label != -100 for label in s.labels[1:]) for s in samples)
    with torch.no_grad():
        return float(ForwardLoss()(model, collate(samples, 0), info.device)) / n_targets


def judge(model_type: str, work: Path) -> dict[str, Any]:
    """One family's row of the matrix (run in a child process of its own)."""
    from qlora_fsdp.errors import UserError
    from tests.helpers import tiny_config, variable_length_samples

    try:
        model_dir = tiny_model(model_type, work / "model")
        samples = variable_length_samples(tiny_config(model_dir), N_SAMPLES)
        reference = reference_loss_of(model_dir, samples)
    except Exception as error:  # transformers' side: nothing of ours is judged
        return {"status": "not built", "why": one_line(error)}
    try:
        ours = our_loss(model_dir, samples, work / "out")
    except UserError as error:
        return {"status": "refused", "why": one_line(error)}
    except Exception as error:
        return {"status": "failed", "why": one_line(error), "where": traceback.format_exc(limit=-3)}
    exact = abs(ours - reference) <= 1e-4 * abs(reference)
    return {"status": "exact" if exact else "differs", "ours": round(ours, 6), "reference": round(reference, 6)}


def _child(model_type: str, work: Path, result: Path) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        row = judge(model_type, work)
    except BaseException as error:  # noqa: BLE001 (a row, whatever happened)
        row = {"status": "failed", "why": one_line(error)}
    result.write_text(json.dumps(row))


def run_matrix(families: list[str], parallel: int = 2) -> dict[str, dict[str, Any]]:
    """Each family in a forked child (imports shared, a hang or crash costs one row), `parallel` at a time."""
    import qlora_fsdp.loading.factory  # noqa: F401 (imported once, before the forks)
    import tests.test_families  # noqa: F401

    fork = multiprocessing.get_context("fork")
    rows: dict[str, dict[str, Any]] = {}
    pending, running = list(families), {}
    with tempfile.TemporaryDirectory() as tmp:
        while pending or running:
            while pending and len(running) < parallel:
                name = pending.pop(0)
                work = Path(tmp) / name
                work.mkdir()
                process = fork.Process(target=_child, args=(name, work, work / "row.json"))
                process.start()
                running[name] = (process, time.monotonic(), work)
            for name, (process, started, work) in list(running.items()):
                too_big = process.is_alive() and resident_gib(process.pid) > MEMORY_GIB
                if process.is_alive() and time.monotonic() - started < TIMEOUT_S and not too_big:
                    continue
                if process.is_alive():
                    process.kill()
                process.join()
                result = work / "row.json"
                rows[name] = (json.loads(result.read_text()) if result.exists() else
                              {"status": "failed", "why": f"the child ended without a row (exit {process.exitcode}, "
                                                          f"{time.monotonic() - started:.0f} s"
                                                          f"{f', over {MEMORY_GIB} GiB resident' if too_big else ''})"})
                del running[name]
                print(f"{name}: {rows[name]['status']} {rows[name].get('why', '')[:120]}", flush=True)
            time.sleep(0.2)
    return dict(sorted(rows.items()))


STATUSES = ("exact", "refused", "differs", "failed", "not built")


def by_default(model_type: str, past_the_gate: dict[str, Any]) -> str:
    """What a user gets with the defaults: the family's own result if it is checked, else the gate's refusal."""
    from qlora_fsdp.families import CHECKED_FAMILIES

    if model_type in CHECKED_FAMILIES or past_the_gate["status"] == "not built":
        return past_the_gate["status"]
    return "refused"


def resident_gib(pid: int) -> float:
    """A child's resident memory (Linux): a family whose defaults stay large at hidden size 64 is stopped."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # it has just ended
        return 0.0
    return next((int(line.split()[1]) / 2**20 for line in status.splitlines() if line.startswith("VmRSS:")), 0.0)


def counts(rows: dict[str, dict[str, Any]], key: str = "status") -> dict[str, int]:
    return {status: sum(row[key] == status for row in rows.values()) for status in STATUSES}


def docs_table(record: dict[str, Any]) -> str:
    """docs/model-families.md's generated section: the counts, then one row a family."""
    rows = record["families"]
    past, default = (", ".join(f"{n} {status}" for status, n in counts(rows, key).items() if n)
                     for key in ("status", "default"))
    lines = [BEGIN, "", f"transformers {record['transformers']}, {len(rows)} causal LMs of "
             f"`MODEL_FOR_CAUSAL_LM_MAPPING`. Past the gate (`model.unchecked_family=true`): {past}. By default: "
             f"{default}.", "", "| model type | class | by default | past the gate | why |",
             "| --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        why = row.get("why", "").replace("|", "\\|")
        lines.append(f"| {name} | {row['class']} | {row['default']} | {row['status']} | {why} |")
    return "\n".join([*lines, "", END])


def write_docs(record: dict[str, Any]) -> None:
    text = DOCS.read_text()
    head, rest = text.split(BEGIN, 1)
    DOCS.write_text(head + docs_table(record) + rest.split(END, 1)[1])


def main(argv: list[str]) -> int:
    import transformers

    families = causal_lm_families()
    only_defaults = argv == ["--defaults"]  # CHECKED_FAMILIES changed: the defaults again, nothing re-run
    rows = {} if only_defaults else run_matrix(argv or list(families))
    old = json.loads(RECORD.read_text())["families"] if RECORD.exists() and argv else {}
    merged = {**old, **{name: {"class": families[name], **row} for name, row in rows.items()}}
    merged = {name: {**row, "default": by_default(name, row)} for name, row in sorted(merged.items())}
    record = {"transformers": transformers.__version__, "families": merged}
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    write_docs(record)
    print(counts(merged), counts(merged, "default"))
    bad = [name for name, row in merged.items() if row["default"] in JUDGED_FAILURES]
    if bad:
        print(f"differs or failed: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
