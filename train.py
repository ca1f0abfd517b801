"""Fine-tune: `torchrun --nproc_per_node 2 train.py --recipe tiny_cpu [key=value ...]`, or `python train.py ...`
for one process. The command line is qlora_fsdp.commands.train; `python train.py --help` prints it."""

from qlora_fsdp.commands.train import entry

if __name__ == "__main__":
    entry()
