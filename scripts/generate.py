"""`python scripts/generate.py --adapter A`: sample from the base + adapter (qlora_fsdp.commands.generate, or
qlora-generate; --help lists the options). Under torchrun, as training ran: `torchrun --nproc_per_node 2 ...`."""

from qlora_fsdp.commands.generate import entry

if __name__ == "__main__":
    entry()
