"""A chat worker: the 4-bit base with one adapter (or none), in a process of its own, as `qlora-generate` loads it;
the page sends it prompts and reads the reply as it grows. A process of its own keeps the model's memory (a GPU's
too) out of the page's server and frees it when the page lets the worker go.

    python -m qlora_fsdp.studio.chat_worker --adapter ADAPTER      # then one JSON request a line on stdin
    python -m qlora_fsdp.studio.chat_worker --recipe tiny_cpu --no-adapter

Request: {"prompt": ..., "system": ..., "max_new_tokens": ..., "temperature": ..., "top_p": ..., "seed": ...};
answer lines: {"text": the reply so far} as tokens come, then {"reply": the whole reply}. The first line is
{"ready": true} once loaded, or {"error": "error: ..."}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from transformers.generation.streamers import BaseStreamer

from qlora_fsdp.errors import UserError


def send(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


class GrowingReply(BaseStreamer):
    """Sends the reply decoded so far after each new token (decoding the whole keeps multi-token characters and
    harmony channels whole)."""

    def __init__(self, decode: Any) -> None:
        self.decode, self.prompt_seen = decode, False
        self.ids: list[int] = []

    def put(self, value: Any) -> None:
        if not self.prompt_seen:  # generate's first call hands over the prompt
            self.prompt_seen = True
            return
        self.ids.extend(int(token) for token in value.reshape(-1).tolist())
        send({"text": self.decode(self.ids)})

    def end(self) -> None:
        pass


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapter", type=Path)
    parser.add_argument("--recipe")
    parser.add_argument("--no-adapter", action="store_true")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def serve(argv: list[str]) -> int:
    from qlora_fsdp.config import load_config
    from qlora_fsdp.data.sources import alpaca_user_turn
    from qlora_fsdp.loading.adapter import config_for_adapter
    from qlora_fsdp.tools.adapter_sampling import Sampling, load_generator, readable_reply

    args = parse_args(argv)
    try:
        if args.no_adapter:
            cfg = load_config(args.recipe, args.overrides)
        else:
            if args.adapter is None or not args.adapter.is_dir():
                raise UserError(f"adapter folder not found: {args.adapter}; train a run first, or give its "
                                "OUTPUT_DIR/adapter")
            cfg = config_for_adapter(args.adapter, args.recipe, args.overrides)
        generator = load_generator(cfg, None if args.no_adapter else args.adapter)
    except UserError as err:
        send({"error": f"error: {err}"})
        return 2
    send({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        sampling = Sampling(int(request.get("max_new_tokens", 128)), float(request.get("temperature", 0.0)),
                            float(request.get("top_p", 1.0)), int(request.get("seed", 0)))
        streamer = GrowingReply(lambda ids: readable_reply(generator.tokenizer, ids))
        reply = generator.reply(alpaca_user_turn(request["prompt"], ""), sampling, request.get("system") or None,
                                streamer=streamer)
        send({"reply": reply})
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
