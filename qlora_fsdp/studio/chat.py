"""The page's side of chat and of the tools after training: chat workers (chat_worker.py) kept per adapter, and
merge and GGUF export run as the command line runs them (`qlora-merge`, `qlora-export`), their last lines shown."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from qlora_fsdp.config import REPO_ROOT
from qlora_fsdp.errors import UserError
from qlora_fsdp.studio.environment import child_environment
from qlora_fsdp.studio.processes import last_error_line

BASE_MODEL = "(base model, no adapter)"


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    system: str = ""

    def request(self, prompt: str) -> str:
        return json.dumps({"prompt": prompt, "system": self.system, "max_new_tokens": self.max_new_tokens,
                           "temperature": self.temperature, "top_p": self.top_p})


class ChatWorker:
    """One loaded adapter in its own process; one reply at a time."""

    def __init__(self, arguments: list[str]) -> None:
        self.lock = threading.Lock()
        self.process = subprocess.Popen([sys.executable, "-m", "qlora_fsdp.studio.chat_worker", *arguments],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, bufsize=1, env=child_environment())
        first = self.read()
        if "error" in first:
            self.close()
            raise UserError(str(first["error"]).removeprefix("error: "))

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                return dict(json.loads(line))
        stderr = self.process.stderr.read() if self.process.stderr else ""
        return {"error": last_error_line(stderr)}

    def stream(self, prompt: str, settings: Settings) -> Iterator[str]:
        """The reply as it grows; the last item is the whole reply."""
        with self.lock:
            assert self.process.stdin is not None
            self.process.stdin.write(settings.request(prompt) + "\n")
            self.process.stdin.flush()
            while True:
                record = self.read()
                if "error" in record:
                    raise UserError(str(record["error"]).removeprefix("error: "))
                if "reply" in record:
                    yield str(record["reply"])
                    return
                yield str(record["text"])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class ChatWorkers:
    """Workers by adapter, loaded on first use; at most `keep` at once (compare needs two)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.workers: dict[str, ChatWorker] = {}

    def worker(self, adapter: str, recipe: str) -> ChatWorker:
        key = f"{adapter}|{recipe}"
        if key not in self.workers:
            while len(self.workers) >= self.keep:
                self.workers.pop(next(iter(self.workers))).close()
            self.workers[key] = ChatWorker(worker_arguments(adapter, recipe))
        return self.workers[key]

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()


def worker_arguments(adapter: str, recipe: str) -> list[str]:
    adapter = adapter.strip()
    if not adapter or adapter == BASE_MODEL:
        if not recipe.strip():
            raise UserError("the base model alone needs a recipe to know it: pick one on the Recipe tab")
        return ["--no-adapter", "--recipe", recipe.strip()]
    return ["--adapter", adapter]


def tool_command(tool: str, adapter: str, out: str, extra: list[str]) -> list[str]:
    """merge or export, as the command line runs it."""
    script = {"merge": "merge_adapter.py", "export": "export_gguf.py"}[tool]
    if not adapter.strip() or not out.strip():
        raise UserError(f"{tool} needs an adapter folder and an output folder")
    return [sys.executable, str(REPO_ROOT / "scripts" / script), "--adapter", adapter.strip(), "--out", out.strip(),
            *extra]


TOOL_LINES = 12  # an export's report: the file, the Modelfile, Ollama's and llama.cpp's commands


def run_tool(command: list[str]) -> tuple[bool, str]:
    """(succeeded, what it printed last): its result line, or its one-line error."""
    done = subprocess.run(command, capture_output=True, text=True, env=child_environment())
    if done.returncode != 0:
        return False, last_error_line(done.stderr)
    lines = done.stdout.strip().splitlines()
    return True, "\n".join(lines[-TOOL_LINES:])
