"""The studio: a local web page that picks a recipe, plans it, trains it, follows it, and chats with the result.

    qlora-studio                       # http://127.0.0.1:7860, this machine only
    qlora-studio --port 8000 --recipe llama70b_2x4090
    make studio

It drives the same library as the command line (train.py, --plan, qlora-generate, qlora-merge, qlora-export) and
shows the exact command for each run. It listens on 127.0.0.1 only: anyone who reaches the page can start
processes on this machine, so reach it from elsewhere through an SSH tunnel (ssh -L 7860:127.0.0.1:7860 host).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from qlora_fsdp.commands.exit import run_command
from qlora_fsdp.errors import UserError


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    parser.add_argument("--recipe", default="tiny_cpu", help="the recipe the page opens with")
    parser.add_argument("--state-dir", type=Path, default=Path("outputs/studio"),
                        help="where the page keeps its runs' logs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> int:
    from qlora_fsdp.studio.app import answers, serve
    from qlora_fsdp.studio.session import Studio

    studio = Studio(args.state_dir)
    if studio.load_recipe(args.recipe)[0] is None:
        raise UserError(studio.load_recipe(args.recipe)[1].removeprefix("error: "))
    try:
        page = serve(studio, args.host, args.port, args.recipe)
    except OSError as err:
        raise UserError(f"cannot listen on {args.host}:{args.port} ({err}); pass --port with a free one") from err
    url = f"http://{args.host}:{args.port}"
    print(f"studio: {url} (Ctrl-C stops it; a run it started is stopped with a checkpoint)", flush=True)
    if not answers(url):
        print(f"warning: {url} has not answered for 30 s (a busy machine, or a proxy that catches local addresses: "
              "set NO_PROXY=127.0.0.1,localhost); the page keeps listening", flush=True)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        stopping.wait()
    except KeyboardInterrupt:
        pass
    finally:
        page.close()
        studio.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
