"""`python scripts/export_gguf.py --adapter A --out OUT`: an adapter (merged first) or a merged folder as a GGUF file
with an Ollama Modelfile (qlora_fsdp.commands.export, or qlora-export; --help lists the options)."""

import sys

from qlora_fsdp.commands.export import main

if __name__ == "__main__":
    sys.exit(main())
