"""Data sources -> one Hugging Face dataset of conversations, mixed by weight.

A source is a JSON/JSONL/Parquet/CSV file, a folder of such files, a `save_to_disk` folder, or a hub id.
Every record becomes a `messages` list of {role, content, reasoning_content, tool_calls, tool_call_id} and a
`tools` text: alpaca records a user/assistant pair, chats (and ShareGPT `conversations`) their turns, plain
text one turn of role `text` (trained on whole). Tool calls (OpenAI's assistant `tool_calls`, or ShareGPT's
`function_call` turns) and the record's `tools` are checked here and carried as JSON text: Arrow needs one
schema for every record, and tool arguments differ from record to record.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import datasets

from qlora_fsdp.config import DataConfig, SourceConfig
from qlora_fsdp.data.tool_calls import tool_calls_of, tools_of
from qlora_fsdp.errors import DataError, first_line

# a reply's reasoning as datasets name it: Qwen3 / DeepSeek, gpt-oss (its cookbook's Multilingual-Thinking), others
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
DEFAULT_FIELDS = {
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system"},
    "chat": {"messages": "messages", "role": "role", "content": "content", "tools": "tools"},
    "sharegpt": {"messages": "conversations", "role": "from", "content": "value", "tools": "tools"},
    "text": {"text": "text"},
}
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "model": "assistant", "tool": "tool", "observation": "tool", "function": "tool", "ipython": "tool"}
CALL_ROLES = ("function_call", "tool_call")  # ShareGPT turns (glaive, LLaMA-Factory) holding the assistant's calls
MESSAGE_FIELDS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id")
Message = dict[str, str]
# stated, not inferred: an input column of the same name (a chat's `tools` list) would lend its type to ours
CONVERSATION = datasets.Features({"messages": datasets.List(dict.fromkeys(MESSAGE_FIELDS, datasets.Value("string"))),
                                  "tools": datasets.Value("string")})


def message(role: str, content: str, **extra: str) -> Message:
    """Every message carries every field (one Arrow schema); templates leave the empty ones out."""
    return {**dict.fromkeys(MESSAGE_FIELDS, ""), "role": role, "content": content, **extra}


def sources_of(data: DataConfig) -> list[SourceConfig]:
    return data.sources or [SourceConfig(path=data.path, format=data.format, fields=data.fields)]


def mixed_conversations(sources: list[SourceConfig], seed: int, cache_dir: str | None) -> datasets.Dataset:
    """Every source as conversations, each repeated or subsampled by its weight, concatenated."""
    parts = []
    for source in sources:
        conversations = as_conversations(read_source(source, cache_dir), source)
        parts.append(weighted(conversations, source.weight, seed))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def read_source(source: SourceConfig, cache_dir: str | None) -> datasets.Dataset:
    """The source's records, their turn lists checked (before any kind of data looks into them)."""
    records = read_records(source, cache_dir)
    check_turn_lists(records, source)
    return records


def check_turn_lists(records: datasets.Dataset, source: SourceConfig) -> None:
    """A chat or ShareGPT source's turns are lists of messages, or one line names the first record whose are not
    (a string there would otherwise be read character by character)."""
    defaults = DEFAULT_FIELDS.get(source.format, {})
    if "messages" not in defaults:
        return
    name = source.fields.get("messages", defaults["messages"])
    feature = records.features.get(name) if records.features is not None else None
    if feature is None or isinstance(feature, (datasets.List, datasets.LargeList, list)):
        return  # absent (the conversation maker names the record), or a list in every record
    for index, turns in enumerate(records[name]):
        if not isinstance(turns, list) or not all(isinstance(turn, dict) for turn in turns):
            raise DataError(f"{source.path}: record {index + 1} lacks the list of turns '{name}' (got "
                            f"{type(turns).__name__}: {turns!r:.40})")


def eval_source(data: DataConfig) -> SourceConfig | None:
    """data.eval_path as a source in the first source's format and fields: the held-out records, where given."""
    if not data.eval_path:
        return None
    first = sources_of(data)[0]
    return SourceConfig(path=data.eval_path, format=first.format, fields=first.fields)


def read_records(source: SourceConfig, cache_dir: str | None) -> datasets.Dataset:
    path = Path(source.path)
    if path.is_dir() and any((path / name).is_file() for name in ("dataset_dict.json", "state.json")):
        return split_of(datasets.load_from_disk(str(path)), source)
    if path.exists():
        return read_files(data_files(path), cache_dir)
    if local_path(source.path):
        raise DataError(f"data source {source.path} does not exist")
    try:  # a hub dataset id
        return datasets.load_dataset(source.path, source.subset, split=source.split, cache_dir=cache_dir)
    except Exception as err:
        raise DataError(f"data source '{source.path}' is neither a local path nor a reachable hub dataset "
                        f"({type(err).__name__})") from None


def local_path(path: str) -> bool:
    """A path on this machine, not a hub dataset id (one slash at most, no data file suffix)."""
    file = Path(path)
    return file.exists() or path.startswith((".", "/")) or path.count("/") > 1 or file.suffix in FILE_BUILDERS


def split_of(loaded: datasets.Dataset | datasets.DatasetDict, source: SourceConfig) -> datasets.Dataset:
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise DataError(f"{source.path} has splits {sorted(loaded)}, not '{source.split}'")
        return loaded[source.split]
    return loaded


def data_files(path: Path) -> list[Path]:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in FILE_BUILDERS)
    if not files:
        raise DataError(f"{path} holds no data files ({', '.join(FILE_BUILDERS)})")
    if any(f.suffix not in FILE_BUILDERS for f in files):
        raise DataError(f"{files[0]}: unsupported data file type; use one of {', '.join(FILE_BUILDERS)}")
    kinds = {FILE_BUILDERS[f.suffix] for f in files}
    if len(kinds) > 1:
        raise DataError(f"{path} mixes file types {sorted(kinds)}; list them as separate data.sources")
    return files


def read_files(files: list[Path], cache_dir: str | None) -> datasets.Dataset:
    builder = FILE_BUILDERS[files[0].suffix]
    # datasets logs its own, row-numbered error before raising; ours (file and line) replaces it
    json_logger = logging.getLogger("datasets.packaged_modules.json.json")
    level, json_logger.level = json_logger.level, logging.CRITICAL
    try:
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", cache_dir=cache_dir)
    except Exception as err:
        if builder == "json":
            for file in files:
                raise_first_bad_json(file)
        raise DataError(f"{files[0]}: cannot be read as {builder} ({first_line(err)})") from None
    finally:
        json_logger.setLevel(level)


def raise_first_bad_json(file: Path) -> None:
    """Name the file and line of the first malformed record (datasets' own error names neither)."""
    text = file.read_text(errors="replace")
    if file.suffix == ".json" and text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{file}:{err.lineno}: not valid JSON ({err.msg})") from None
        return
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{file}:{line_no}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise DataError(f"{file}:{line_no}: a record must be a JSON object, got {type(record).__name__}")


class ConversationMaker:
    """One record -> {"messages": [...]}; a missing or mistyped field names the record and the field."""

    def __init__(self, source: SourceConfig) -> None:
        self.format, self.origin = source.format, source.path
        unknown = set(source.fields) - set(DEFAULT_FIELDS[source.format])
        if unknown:
            raise DataError(f"data fields {sorted(unknown)} do not apply to format '{source.format}'; "
                            f"its fields are {sorted(DEFAULT_FIELDS[source.format])}")
        self.fields = {**DEFAULT_FIELDS[source.format], **source.fields}
        self.version = 2  # part of the map function's hash: conversations cached by older code are not reused

    def __call__(self, record: dict[str, Any], index: int) -> dict[str, Any]:
        if self.format == "alpaca":
            return {"messages": self.alpaca(record, index), "tools": ""}
        if self.format == "text":
            return {"messages": [message("text", self.text(record, index, "text"))], "tools": ""}
        return {"messages": self.chat(record, index), "tools": self.tools(record, index)}

    def text(self, record: dict[str, Any], index: int, name: str, optional: bool = False) -> str:
        value = record.get(self.fields[name])
        if value is None and optional:
            return ""
        if not isinstance(value, str):
            raise DataError(f"{self.origin}: record {index + 1} lacks the text field '{self.fields[name]}'")
        return value

    def alpaca(self, record: dict[str, Any], index: int) -> list[Message]:
        prompt = alpaca_user_turn(self.text(record, index, "instruction"),
                                  self.text(record, index, "input", optional=True))
        system = self.text(record, index, "system", optional=True)
        turns = [message("system", system)] if system else []
        return turns + [message("user", prompt), message("assistant", self.text(record, index, "output"))]

    def chat(self, record: dict[str, Any], index: int) -> list[Message]:
        turns = record.get(self.fields["messages"])
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{self.origin}: record {index + 1} lacks the list of turns '{self.fields['messages']}'")
        messages: list[Message] = []
        for turn in turns:
            self.add_turn(messages, turn, index)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{self.origin}: record {index + 1} has no assistant turn to learn from")
        return messages

    def add_turn(self, messages: list[Message], turn: Any, index: int) -> None:
        said = str(turn.get(self.fields["role"])).lower() if isinstance(turn, dict) else ""
        content = turn.get(self.fields["content"]) if isinstance(turn, dict) else None
        if said in CALL_ROLES:  # ShareGPT: the value is the call(s) as JSON
            called = self.tool_calls(content, index)
            if messages and messages[-1]["role"] == "assistant" and not messages[-1]["tool_calls"]:
                messages[-1]["tool_calls"] = called  # a reply, then its calls: one assistant turn
            else:
                messages.append(message("assistant", "", tool_calls=called))
            return
        role = ROLES.get(said)
        # OpenAI's tool_calls, or its older single function_call; a message that only calls has content null
        calls = (turn.get("tool_calls") or turn.get("function_call")) if role == "assistant" else None
        if content is None and calls:
            content = ""
        if role is None or not isinstance(content, str):
            raise DataError(f"{self.origin}: record {index + 1} has a turn without a known "
                            f"'{self.fields['role']}' or a text '{self.fields['content']}': {turn!r:.80}")
        extra = {"tool_calls": self.tool_calls(calls, index)} if calls else {}
        reasoning = next((turn[name] for name in REASONING_FIELDS if isinstance(turn.get(name), str)), None)
        if reasoning is not None:
            extra["reasoning_content"] = reasoning
        if isinstance(turn.get("tool_call_id"), str):  # OpenAI's result ids
            extra["tool_call_id"] = turn["tool_call_id"]
        messages.append(message(role, content, **extra))

    def tool_calls(self, value: Any, index: int) -> str:
        try:
            return json.dumps(tool_calls_of(value), ensure_ascii=False)
        except ValueError as err:
            raise DataError(f"{self.origin}: record {index + 1} has a tool call that is not a JSON "
                            f"{{name, arguments}} object ({first_line(err):.120})") from None

    def tools(self, record: dict[str, Any], index: int) -> str:
        value = record.get(self.fields["tools"])
        try:
            tools = tools_of(value)
        except ValueError as err:
            raise DataError(f"{self.origin}: record {index + 1} has {err}") from None
        return json.dumps(tools, ensure_ascii=False) if tools else ""


def as_conversations(dataset: datasets.Dataset, source: SourceConfig) -> datasets.Dataset:
    maker = ConversationMaker(source)
    return dataset.map(maker, with_indices=True, remove_columns=dataset.column_names, features=CONVERSATION,
                       desc=f"reading {source.path}")


def weighted(dataset: datasets.Dataset, weight: float, seed: int) -> datasets.Dataset:
    """`weight` copies of the source: whole copies plus a seeded subset for the fraction."""
    if weight <= 0:
        raise DataError(f"a data source weight must be positive, got {weight}")
    if weight == 1:
        return dataset
    n = len(dataset)
    indices = list(range(n)) * int(weight)
    indices += sorted(random.Random(seed).sample(range(n), round((weight - int(weight)) * n)))
    return dataset.select(indices)


def alpaca_user_turn(instruction: str, extra_input: str = "") -> str:
    """An alpaca record's instruction and optional input as one user turn (training and generation alike)."""
    return f"{instruction}\n\n### Input:\n{extra_input}" if extra_input else instruction
