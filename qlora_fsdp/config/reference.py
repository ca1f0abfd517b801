"""docs/config-reference.md, made from the schema: every key's type and default from the dataclasses, its words
from the comments beside and above it in schema.py and objectives.py (read from the source, so the page cannot
disagree with it).
scripts/config_reference.py writes or checks the page; tests/test_config_reference.py holds them equal."""

from __future__ import annotations

import ast
import dataclasses
import io
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from qlora_fsdp.config import generation, objectives, schema
from qlora_fsdp.config.schema import FSDP_CONFIGS_DIR, REPO_ROOT, Config
from qlora_fsdp.optimizer_registry import OPTIMIZERS

PAGE = REPO_ROOT / "docs" / "config-reference.md"
REGENERATE = "python scripts/config_reference.py --write"
HEADER = f"""# Config reference

<!-- Generated from qlora_fsdp/config/schema.py by scripts/config_reference.py: do not edit by hand. -->

Every key a recipe can set, with its type, its default and what it does. This page is generated from
`qlora_fsdp/config/schema.py` (the comments there are the descriptions): after changing the schema, run
`{REGENERATE}`; `tests/test_config_reference.py` fails while the page is out of date.

## How a run's config is put together

1. The defaults below.
2. The `fsdp_preset` file from `fsdp_configs/`, merged under the `fsdp` section.
3. The recipe (`--recipe NAME` for `recipes/NAME.yaml`, or a path to a YAML file). A recipe sets only what differs
   from the defaults: copy one from `recipes/` and change what you need.
4. Overrides on the command line, each `key=value` with the dotted key, read as YAML:

   ```
   python train.py --recipe tiny_cpu optim.lr=3e-4 data.packing=true lora.target_modules=[q_proj,v_proj]
   ```

A misspelt key, a value of the wrong type or a choice not in the list stops the run with one `error:` line
before anything is loaded (docs/troubleshooting.md lists them). Booleans are `true`/`false` (`yes`/`no`/`on`/`off`
too), `null` is "not set". Where a key is a choice, its type lists the allowed values.
"""


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    text: str


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class, field) -> the comment lines directly above the field and the comment on its own line, joined."""
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    found: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                words = [*comment_above(lines, comments, item.lineno), comments.get(item.end_lineno or item.lineno, "")]
                found[node.name, item.target.id] = " ".join(words).strip()
    return found


def comment_above(lines: list[str], comments: dict[int, str], lineno: int) -> list[str]:
    """The run of comment-only lines that ends right above line `lineno` (1-based), top first."""
    above: list[str] = []
    line = lineno - 1
    while line >= 1 and lines[line - 1].lstrip().startswith("#"):
        above.insert(0, comments[line])
        line -= 1
    return above


def type_words(annotation: Any) -> str:
    """A type as a recipe writer reads it: `int`, `"nf4" | "fp4"`, `list[str]`, `int | "auto"`, `float | null`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_words(a) for a in args)
    if origin is list:
        return f"list[{type_words(args[0])}]"
    if origin is dict:
        return f"dict[{type_words(args[0])}, {type_words(args[1])}]"
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if dataclasses.is_dataclass(annotation):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def yaml_value(value: Any) -> str:
    """A default as it would be written in a recipe."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text.removesuffix("...").strip()


def choices_elsewhere() -> dict[str, list[str]]:
    """Keys typed `str` whose values are limited by a registry or a folder, not by the type."""
    return {"optim.name": list(OPTIMIZERS), "fsdp_preset": sorted(p.stem for p in FSDP_CONFIGS_DIR.glob("*.yaml"))}


def section_class(hint: Any) -> type | None:
    """The dataclass a hint names (a section, or a list item), else None."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def section_rows(cls: type, prefix: str, comments: dict[tuple[str, str], str]) -> list[Row]:
    hints, defaults, extra = typing.get_type_hints(cls), cls(), choices_elsewhere()
    rows = []
    for f in dataclasses.fields(cls):
        if section_class(hints[f.name]):
            continue  # a section of its own
        key, text = f"{prefix}{f.name}", comments.get((cls.__name__, f.name), "")
        if key in extra:
            text += f"; one of: {', '.join(f'`{name}`' for name in extra[key])}."
        rows.append(Row(key, type_words(hints[f.name]), yaml_value(getattr(defaults, f.name)), text))
    return rows


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(rows: list[Row]) -> str:
    lines = ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]
    lines += [f"| `{r.key}` | `{cell(r.type)}` | `{cell(r.default)}` | {cell(r.text)} |" for r in rows]
    return "\n".join(lines)


def class_text(cls: type) -> str:
    """A section's docstring, on one line, where it has one."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(f"{cls.__name__}(") else " ".join(doc.split())  # dataclass's generated signature


def sections(comments: dict[tuple[str, str], str]) -> list[str]:
    """One markdown block per Config field: a table for each section, and one for a list-of-mappings key."""
    hints: dict[str, Any] = typing.get_type_hints(Config)
    blocks = []
    for f in dataclasses.fields(Config):
        cls = section_class(hints[f.name])
        if cls is None:
            blocks.append(f"## `{f.name}`\n\n{table(top_rows(f, comments))}")
            continue
        intro = class_text(cls)
        blocks.append("\n\n".join(part for part in (f"## `{f.name}`", intro,
                                                    table(section_rows(cls, f"{f.name}.", comments))) if part))
        blocks += list_sections(cls, f"{f.name}.", comments)
    return blocks


def top_rows(f: dataclasses.Field, comments: dict[tuple[str, str], str]) -> list[Row]:
    return [row for row in section_rows(Config, "", comments) if row.key == f.name]


def list_sections(cls: type, prefix: str, comments: dict[tuple[str, str], str]) -> list[str]:
    """A table for each key that holds a list of mappings (data.sources), after its section's table."""
    blocks = []
    hints: dict[str, Any] = typing.get_type_hints(cls)
    for name, hint in hints.items():
        item = section_class(typing.get_args(hint)[0]) if typing.get_origin(hint) is list else None
        if item is not None:
            key = f"{prefix}{name}"
            intro = f"Each item of `{key}` is a mapping with these keys (written `{key}[].KEY` here)."
            blocks.append(f"## `{key}[]`\n\n{intro}\n\n{table(section_rows(item, f'{key}[].', comments))}")
    return blocks


def schema_comments() -> dict[tuple[str, str], str]:
    """Every field's words, from schema.py and its section modules (objectives.py, generation.py)."""
    return {key: text for module in (schema, objectives, generation)
            for key, text in field_comments(Path(str(module.__file__)).read_text()).items()}


def render() -> str:
    """The whole page."""
    comments = schema_comments()
    return "\n\n".join([HEADER.rstrip(), *sections(comments)]) + "\n"


def missing_comments() -> list[str]:
    """Keys with no words in schema.py (the page would leave their description empty)."""
    comments = schema_comments()
    return [line.split("|")[1].strip(" `") for block in sections(comments) for line in block.splitlines()
            if line.startswith("| `") and line.rstrip().endswith("|  |")]
