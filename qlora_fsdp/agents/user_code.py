"""A recipe's own Python: `module:function` (importable from the working directory) or `path/to/file.py:function`."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from qlora_fsdp.errors import ConfigError


def load_file(path: Path) -> ModuleType:
    found = importlib.util.spec_from_file_location(path.stem, path)
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def import_module(spec: str, name: str, what: str) -> ModuleType:
    """An installed module, one beside train.py, or one under the working directory (the user's own file)."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        beside = Path.cwd() / (name.replace(".", "/") + ".py")
        if not beside.is_file():
            raise ConfigError(f"{what} {spec!r}: cannot import {name} ({error})") from None
    return load_file(beside)


def import_function(spec: str, what: str) -> Any:
    """The callable `spec` names; a ConfigError that starts with `what` (e.g. 'reward function') otherwise."""
    module_name, _, attribute = spec.rpartition(":")
    if not module_name:
        raise ConfigError(f"{what} {spec!r}: write module:function or path/to/file.py:function")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ConfigError(f"{what} {spec!r}: no file {path}")
        module = load_file(path)
    else:
        module = import_module(spec, module_name, what)
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"{what} {spec!r}: {module_name} has no function {attribute!r}")
    return function
