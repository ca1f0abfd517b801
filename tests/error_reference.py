"""docs/troubleshooting.md, made from the bad-input corpus (tests/test_bad_inputs.py): each case's situation (its
docstring), the one `error:` line train.py prints for it (run in-process, as the test runs it) and, where the line
does not say it, the case's fix. `python -m tests.error_reference` runs the cases and writes the page; the drift
test (tests/test_error_reference.py) checks the page against the corpus without running them."""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
from pathlib import Path

from tests.helpers import REPO, build_tiny_checkpoint
from tests.test_bad_inputs import CASES, BadInput, train_argv

PAGE = REPO / "docs" / "troubleshooting.md"
CORPUS = REPO / "tests" / "test_bad_inputs.py"
REGENERATE = "python -m tests.error_reference --write"
SECTION = re.compile(r"^# --- (.+?) -+$")
MARKER = re.compile(r"^<!-- case: (\w+) -->$")
HEADER = f"""# Troubleshooting

<!-- Generated from tests/test_bad_inputs.py by `python -m tests.error_reference`: do not edit by hand. -->

A mistake in a recipe, an override, a data file, a model folder or a run folder ends `train.py` before any weight
is read, with exit code 2, one line that starts with `error:`, and the output folder as it was. That line names the
file or key and, nearly always, the fix. Below, every such line the test corpus (`tests/test_bad_inputs.py`)
checks, as printed (`<folder>` stands for where your files are). To regenerate this page after changing the corpus
or a message: `{REGENERATE}` (`tests/test_error_reference.py` fails while it is out of date)."""


def sections() -> list[tuple[str, list[BadInput]]]:
    """The corpus's `# --- name ---` sections, in order, each with the cases defined under it."""
    starts = [(number, match.group(1)) for number, line in enumerate(CORPUS.read_text().splitlines(), 1)
              if (match := SECTION.match(line))]
    grouped: dict[str, list[BadInput]] = {name: [] for _, name in starts}
    for case in CASES:
        line = case.setup.__code__.co_firstlineno
        grouped[[name for start, name in starts if start < line][-1]].append(case)
    return list(grouped.items())


def run_case(case: BadInput, folder: Path, model: Path) -> str:
    """The `error:` line train.py prints for a case, with this machine's paths as placeholders."""
    from qlora_fsdp.commands.train import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(train_argv(case.setup(folder, model), folder / "run", model))
    lines = [line for line in err.getvalue().splitlines() if line.startswith("error: ")]
    if code != 2 or len(lines) != 1 or not re.search(case.expected, lines[0].removeprefix("error: ")):
        raise RuntimeError(f"{case.name}: expected one error line matching {case.expected!r}, got {lines}")
    return placeholders(lines[0], folder, model)


def placeholders(line: str, folder: Path, model: Path) -> str:
    for path, word in ((folder.resolve(), "<folder>"), (folder, "<folder>"), (model.resolve(), "<model>"),
                       (model, "<model>"), (REPO, ".")):
        line = line.replace(str(path), word)
    return line


def run_all() -> dict[str, str]:
    """Every case's line, each in a fresh folder, against one tiny checkpoint (as the test's fixture builds it)."""
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_checkpoint(Path(tmp) / "tiny-llama")
        lines = {}
        for case in CASES:
            with tempfile.TemporaryDirectory(dir=tmp) as folder:
                lines[case.name] = run_case(case, Path(folder), model)
        return lines


def case_block(case: BadInput, line: str) -> str:
    fix = f"\n\nFix: {case.fix[0].upper()}{case.fix[1:]}" if case.fix else ""
    return f"<!-- case: {case.name} -->\n**{case.situation}**\n\n```\n{line}\n```{fix}"


def rank_errors_section() -> str:
    """Errors a multi-rank run adds (tests/test_rank_errors.py, tests/test_first_contact.py hold them)."""
    return """## Under torchrun: ranks, timeouts, full disks

These come from runs of several processes; `tests/test_rank_errors.py` and `tests/test_first_contact.py` check them.

- **A user error under `torchrun`.** The `error:` line is printed once (by the rank that hit it), every rank exits
  2, and torchrun then prints its own `ChildFailedError` report, whose "Root Cause" names that line. The line is the
  message to read; the report around it is torchrun's. A rank left waiting in a collective when another rank hits
  such an error ends with that rank's line, not a traceback of its own.
- **The disk fills while a checkpoint is written.** `error: disk full: writing checkpoint step-N to <folder> failed
  (...; X GiB free there). Free space or point train.output_dir at a larger disk (fewer kept: train.keep_last);
  resume from <checkpoint> (the last complete checkpoint) with --resume`. The partial checkpoint is removed; the
  earlier ones are whole.
- **A rank waits too long for another** (rank 0 tokenizing a large dataset, saving, or a rank that died): `error: a
  collective waited longer than train.collective_timeout_minutes=60 for another rank (...)`. Look at the other
  ranks' logs first; if rank 0 was only busy, raise `train.collective_timeout_minutes`. (This is the line for the
  waits that run over gloo, the barriers; a timed-out NCCL collective is ended by NCCL's own watchdog.)
- **The first all-reduce hangs** (broken GPU peer-to-peer access, common on pairs of consumer GPUs such as two RTX
  4090s): `error: the first all-reduce between the 2 ranks did not finish in 60 s: on consumer GPUs this is usually
  broken peer-to-peer access; try NCCL_P2P_DISABLE=1, a newer driver, or PCIe ACS off in the BIOS`. It is checked
  before any weight is read, within `train.first_collective_timeout_s`."""


def render(lines: dict[str, str]) -> str:
    """The page, from each case's error line (by case name)."""
    blocks = [HEADER]
    for name, cases in sections():
        blocks.append(f"## {name[0].upper()}{name[1:]}")
        blocks += [case_block(case, lines[case.name]) for case in cases]
    blocks.append(rank_errors_section())
    return "\n\n".join(blocks) + "\n"


def recorded_lines(page: str) -> dict[str, str]:
    """Each case's error line as a page shows it (the code block after its marker)."""
    found, rows = {}, page.splitlines()
    for index, row in enumerate(rows):
        if (match := MARKER.match(row)) and index + 4 < len(rows):
            found[match.group(1)] = rows[index + 4]
    return found


if __name__ == "__main__":  # python -m tests.error_reference [--write]: about 20 s on 2 cores
    import argparse
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the corpus never needs the network
    parser = argparse.ArgumentParser(description="Run the bad-input corpus and print docs/troubleshooting.md")
    parser.add_argument("--write", action="store_true", help="write docs/troubleshooting.md")
    page = render(run_all())
    if parser.parse_args().write:
        PAGE.write_text(page)
    else:
        print(page, end="")
