"""Loading a recipe: YAML, the fsdp preset merged under it, dotted `key=value` overrides, validation."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from qlora_fsdp.config.generation import MOVED_TO_GENERATION
from qlora_fsdp.config.schema import (
    FSDP_CONFIGS_DIR,
    RECIPES_DIR,
    Config,
)
from qlora_fsdp.config.validation import validate
from qlora_fsdp.errors import ConfigError


class RecipeLoader(yaml.SafeLoader):
    """yaml.safe_load, except that only true/false are booleans: YAML 1.1 also reads yes/no/on/off as booleans,
    which turns `activation_checkpointing.mode: off` into false. Keys that are booleans take yes/no/on/off
    (see _check_type); keys that are strings get the word as written."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))
BOOLEAN_WORDS = {"yes": True, "on": True, "no": False, "off": False}


def read_yaml_text(text: str) -> Any:
    return yaml.load(text, Loader=RecipeLoader)  # noqa: S506 (RecipeLoader is a SafeLoader)


def resolve_recipe_path(recipe: str) -> Path:
    """`tiny_cpu` -> recipes/tiny_cpu.yaml; a path to a YAML file is taken as is."""
    as_path = Path(recipe)
    if as_path.suffix in (".yaml", ".yml") or as_path.is_file():
        if not as_path.is_file():
            raise ConfigError(f"recipe file not found: {as_path}")
        return as_path
    candidate = RECIPES_DIR / f"{recipe}.yaml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    hint = difflib.get_close_matches(recipe, known, n=1)
    suggestion = f"did you mean '{hint[0]}'? " if hint else ""
    raise ConfigError(f"unknown recipe '{recipe}': {suggestion}known recipes: {', '.join(known)}")


def load_config(recipe: str, overrides: Sequence[str] = (), saved_by_a_run: bool = False) -> Config:
    """Recipe YAML, then its fsdp preset under the recipe's own `fsdp` keys, then command-line overrides.
    saved_by_a_run: the file is a run's resolved config (an adapter's or a checkpoint's), whose renamed values
    are read as their new names rather than refused."""
    path = resolve_recipe_path(recipe)
    raw = _read_yaml(path)
    raw = upgraded(raw) if saved_by_a_run else raw
    override_tree: dict[str, Any] = {}
    for item in overrides:
        override_tree = _merge(override_tree, _parse_override(item))
    preset = override_tree.get("fsdp_preset", raw.get("fsdp_preset", Config.fsdp_preset))
    tree = _merge({"fsdp": _read_preset(preset)}, raw)
    _build(Config, tree, prefix="", source=str(path))  # so an error names the file it came from
    return validate(_build(Config, _merge(tree, override_tree), prefix="", source="the command-line overrides"))


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


# how a run starts or is observed, not what it computes (a trailing dot: the whole section)
RUN_CONTROL_KEYS = ("train.resume", "train.overwrite", "train.collective_timeout_minutes",
                    "train.first_collective_timeout_s", "logging.", "profile.")


def changed_settings(saved_yaml: str, config: Config) -> list[str]:
    """`key: old -> new` for every setting that differs from a checkpoint's resolved config."""
    def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out = {}
        for key, value in tree.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return out

    # a key added since the checkpoint was written: that run used its default (lora.use_rslora: false)
    before = flat(read_yaml_text(to_yaml(Config()))) | flat(upgraded(read_yaml_text(saved_yaml) or {}))
    after = flat(read_yaml_text(to_yaml(config)))
    return [f"{key}: {before.get(key)!r} -> {after.get(key)!r}" for key in sorted(before.keys() | after.keys())
            if before.get(key) != after.get(key) and not key.startswith(RUN_CONTROL_KEYS)]


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = read_yaml_text(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); save the recipe as UTF-8 YAML") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if data is None:  # a truncated copy or the wrong file would otherwise train the defaults
        raise ConfigError(f"{path}: the file is empty (or only comments); a recipe sets at least model.path or "
                          "train.output_dir: copy one from recipes/")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level")
    return data


def _read_preset(name: str) -> dict[str, Any]:
    path = FSDP_CONFIGS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in FSDP_CONFIGS_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown fsdp_preset '{name}': choose one of {', '.join(known)}")
    return _read_yaml(path)


def override_key(item: str) -> str:
    return item.partition("=")[0].strip()


def merged_overrides(earlier: Sequence[str], later: Sequence[str]) -> list[str]:
    """`key=value` overrides with each of `later` replacing any earlier one of its key: the last one wins, as on the
    command line (blank items dropped)."""
    keys = {override_key(item) for item in later}
    return [item for item in earlier if item.strip() and override_key(item) not in keys] + list(later)


def last_override(overrides: Sequence[str], key: str) -> str | None:
    """The value the command line takes for `key`: its last override's, or None where none sets it."""
    values = [item.partition("=")[2].strip() for item in overrides if override_key(item) == key]
    return values[-1] if values else None


def _parse_override(item: str) -> dict[str, Any]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{item}' is not of the form key=value (for example optim.lr=3e-4)")
    try:
        parsed = read_yaml_text(value) if value else ""
    except yaml.YAMLError:
        parsed = value
    tree: dict[str, Any] = {}
    node = tree
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = parsed
    return tree


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(_all_keys(hints[f.name], f"{name}."))
        else:
            keys.append(name)
    return keys


def _build(cls: type, tree: Any, prefix: str, source: str) -> Any:
    if not isinstance(tree, dict):
        raise ConfigError(f"'{prefix.rstrip('.')}' in {source} must be a mapping of keys, got {tree!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            local = [f"{prefix}{name}" for name in names] if "[" in prefix else None  # inside a list item
            raise ConfigError(_unknown_key_message(_first_leaf(dotted, value), source, local))
        if dataclasses.is_dataclass(hints[key]):
            kwargs[key] = _build(hints[key], value, f"{dotted}.", source)
        elif _is_list_of_dataclasses(hints[key]):
            kwargs[key] = _build_list(typing.get_args(hints[key])[0], value, dotted, source)
        else:
            kwargs[key] = _check_type(dotted, value, hints[key])
    return cls(**kwargs)


def _is_list_of_dataclasses(expected: Any) -> bool:
    return typing.get_origin(expected) is list and dataclasses.is_dataclass(typing.get_args(expected)[0])


def _build_list(cls: type, value: Any, dotted: str, source: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"'{dotted}' in {source} must be a list of mappings, got {value!r}")
    return [_build(cls, item, f"{dotted}[{i}].", source) for i, item in enumerate(value)]


def _first_leaf(dotted: str, value: Any) -> str:
    """`optimm: {lr: 1}` is most likely a misspelled `optim.lr`: suggest from the leaf's full name."""
    while isinstance(value, dict) and value:
        key, value = next(iter(value.items()))
        dotted = f"{dotted}.{key}"
    return dotted


# keys and values renamed so each word means one thing ("checkpoint": a training checkpoint, never the
# recomputation, never the base model's folder)
RENAMED_KEYS = {"checkpointing": "activation_checkpointing"}
RENAMED_VALUES = {("model.init", "checkpoint"): "pretrained"}


def upgraded(tree: dict[str, Any]) -> dict[str, Any]:
    """A run's saved config with renamed values under their new names (`model.init: checkpoint`: pretrained) and
    moved keys in their new sections (`grpo.temperature`: generation.temperature)."""
    tree = copy.deepcopy(tree)
    for old, new in MOVED_TO_GENERATION.items():
        old_section, old_leaf = old.split(".")
        new_section, new_leaf = new.split(".")
        section = tree.get(old_section)
        if isinstance(section, dict) and old_leaf in section:
            tree.setdefault(new_section, {})[new_leaf] = section.pop(old_leaf)
    for (dotted, old), new in RENAMED_VALUES.items():
        *sections, leaf = dotted.split(".")
        node: Any = tree
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) == old:
            node[leaf] = new
    return tree


def _unknown_key_message(dotted: str, source: str, candidates: list[str] | None = None) -> str:
    section, dot, rest = dotted.partition(".")
    if section in RENAMED_KEYS:
        return f"'{dotted}' in {source} is now '{RENAMED_KEYS[section]}{dot}{rest}': rename it"
    if dotted in MOVED_TO_GENERATION:
        return f"'{dotted}' in {source} is now '{MOVED_TO_GENERATION[dotted]}' (the generation section): move it"
    candidates = candidates or _all_keys(Config)
    best = difflib.get_close_matches(dotted, candidates, n=1, cutoff=0.5)
    if not best:  # a typo in the section name: compare the last part alone
        leaf = dotted.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in candidates}
        match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        best = [by_leaf[match[0]]] if match else []
    hint = f"; did you mean '{best[0]}'?" if best else ""
    return f"unknown key '{dotted}' in {source}{hint}"


def _check_type(key: str, value: Any, expected: Any) -> Any:
    if isinstance(value, str) and (key, value) in RENAMED_VALUES:
        raise ConfigError(f"'{key}: {value}' is now '{key}: {RENAMED_VALUES[key, value]}': rename it")
    value = _yaml11_float(value) if _accepts_float(expected) else value
    if isinstance(value, str) and value.lower() in BOOLEAN_WORDS and _matches(True, expected):
        value = BOOLEAN_WORDS[value.lower()]  # `packing: yes` on a boolean key
    if _matches(value, expected):
        if expected is float and isinstance(value, int):
            return float(value)
        return value
    raise ConfigError(f"'{key}' must be {_describe(expected)}, got {value!r}")


def _accepts_float(expected: Any) -> bool:
    return expected is float or float in typing.get_args(expected)


def _yaml11_float(value: Any) -> Any:
    """YAML 1.1 reads `3e-4` (no dot) as a string; take it as the number everyone means."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _matches(value: Any, expected: Any) -> bool:
    origin = typing.get_origin(expected)
    args = typing.get_args(expected)
    if expected is Any:
        return True
    if expected is type(None):
        return value is None
    if origin is Literal:
        return value in args
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _describe(expected: Any) -> str:
    origin = typing.get_origin(expected)
    args = typing.get_args(expected)
    if origin is Literal:
        return repr(args[0]) if len(args) == 1 else "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return f"a mapping of {_describe(args[0])} to {_describe(args[1])}"
    if expected is type(None):
        return "null"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        expected, getattr(expected, "__name__", str(expected))
    )


