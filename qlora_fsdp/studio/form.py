"""The recipe form, generated from the schema: one field per key, with its type, its choices and its words from
the config reference (so the form cannot disagree with the schema), and the overrides a filled form means."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

from qlora_fsdp.config import Config
from qlora_fsdp.config.reference import choices_elsewhere, schema_comments, section_class, type_words, yaml_value

Kind = Literal["bool", "choice", "text"]


@dataclass(frozen=True)
class Field:
    key: str  # dotted, as an override names it
    section: str  # the Config field it sits under ("fsdp_preset" for a top-level key)
    kind: Kind  # bool: a checkbox; choice: a drop-down; text: the value as YAML
    choices: tuple[str, ...]  # a choice's values, as YAML
    help: str  # the type and the config reference's words

    @property
    def element_id(self) -> str:
        """The page's id for the field (dots are not CSS-friendly)."""
        return "field-" + self.key.replace(".", "-")


def literal_choices(annotation: Any) -> tuple[str, ...] | None:
    """The values a Literal (or a Literal or None) allows, as YAML; None for any other type."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return tuple(yaml_value(a) for a in args)
    literals = [a for a in args if typing.get_origin(a) is Literal]
    if literals and all(a is type(None) or a in literals for a in args):
        return tuple(yaml_value(v) for lit in literals for v in typing.get_args(lit)) + ("null",)
    return None


def make_field(key: str, section: str, annotation: Any, words: str) -> Field:
    extra = choices_elsewhere().get(key)
    choices = tuple(extra) if extra else literal_choices(annotation)
    kind: Kind = "bool" if annotation is bool else "choice" if choices else "text"
    return Field(key, section, kind, choices or (), f"{type_words(annotation)}: {words}".rstrip(": "))


def form_fields() -> list[Field]:
    """Every key a recipe can set, section by section in the schema's order."""
    comments = schema_comments()
    fields = []
    hints: dict[str, Any] = typing.get_type_hints(Config)
    for top in dataclasses.fields(Config):
        cls = section_class(hints[top.name])
        if cls is None:
            fields.append(make_field(top.name, top.name, hints[top.name], comments.get(("Config", top.name), "")))
            continue
        section_hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if section_class(section_hints[f.name]):
                continue
            fields.append(make_field(f"{top.name}.{f.name}", top.name, section_hints[f.name],
                                     comments.get((cls.__name__, f.name), "")))
    return fields


def plain(value: Any) -> Any:
    """A value as YAML can write it: list items that are sections (data.sources, grpo.rewards) as mappings."""
    if isinstance(value, list):
        return [plain(item) for item in value]
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


def value_of(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return plain(node)


def form_value(cfg: Config, field: Field) -> bool | str:
    """What the field shows for a config: a checkbox's bool, else the value as YAML."""
    value = value_of(cfg, field.key)
    if field.kind == "bool":
        return bool(value)
    return yaml_value(value)  # a list of mappings (data.sources) too, in YAML's flow style


def form_values(cfg: Config, fields: list[Field]) -> list[bool | str]:
    return [form_value(cfg, f) for f in fields]


def override_text(field: Field, value: bool | str | None) -> str:
    if field.kind == "bool":
        return f"{field.key}={'true' if value else 'false'}"
    return f"{field.key}={'' if value is None else str(value).strip()}"


def changed_overrides(cfg: Config, fields: list[Field], values: list[bool | str | None]) -> list[str]:
    """key=value for each field whose value differs from the recipe's, in the form's order."""
    return [override_text(f, value) for f, value in zip(fields, values, strict=True)
            if value is not None and override_text(f, value) != override_text(f, form_value(cfg, f))]
