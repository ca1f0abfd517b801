"""One checkpointed decoder layer's peak memory against the row length, with the MLP whole and in tiles
(`activation_checkpointing.mlp_tile_tokens`).

A Llama decoder layer (hidden 512, MLP 2048, LoRA r=16 on its MLP; fp32 on the CPU, seeded random weights) runs
forward and backward under non-reentrant checkpointing, as training runs every layer; torch's memory tracker counts
the peak of live tensor bytes. Whole, the MLP's intermediate tensors (tokens x 2048, several of them, in the
recompute and its backward) grow with the row; tiled, they exist for one tile at a time, so the peak grows only
with the layer's input and output (tokens x 512) and the attention.

    python -m benchmarks.tiled_mlp                 # rows of 1k to 16k tokens, about a minute on 2 CPU cores
"""

from __future__ import annotations

import argparse

import peft
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from qlora_fsdp.layers.checkpointing import checkpointed
from qlora_fsdp.layers.tiled_mlp import tile_mlp

MIB = 2**20


class FrozenAwareTracker(MemTracker):
    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):  # noqa: ANN001, ANN202
        # its gradient hooks need every parameter to require grad; the frozen base does not
        return super()._track_module_params_and_buffers(module, install_grad_hooks=False)


def layer_peak(tokens: int, tile: int) -> float:
    """MiB of live tensors at the peak of one layer's forward and backward (tile 0: the MLP whole)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=8)
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0)
    layer.requires_grad_(False)
    lora = peft.LoraConfig(r=16, target_modules=["gate_proj", "up_proj", "down_proj"])
    peft.inject_adapter_in_model(lora, layer)  # in place
    if tile:
        tile_mlp(layer.mlp, tile)
    wrapped = checkpointed(layer)
    positions = torch.arange(tokens).unsqueeze(0)
    rotary = LlamaRotaryEmbedding(config)
    x = torch.randn(1, tokens, 512, requires_grad=True)
    tracker = FrozenAwareTracker()
    tracker.track_external(wrapped, x)
    with tracker:
        embeddings = rotary(x, positions)
        out = wrapped(x, position_embeddings=embeddings, position_ids=positions)
        out.float().pow(2).mean().backward()
    return tracker.get_tracker_snapshot("peak")[x.device]["Total"] / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tile", type=int, default=1024)
    args = parser.parse_args()
    print(f"| row tokens | peak, MLP whole (MiB) | peak, MLP in {args.tile}-token tiles (MiB) | tiled / whole |")
    print("| ---: | ---: | ---: | ---: |")
    for tokens in args.tokens:
        whole, tiled = layer_peak(tokens, 0), layer_peak(tokens, args.tile)
        print(f"| {tokens:,} | {whole:,.1f} | {tiled:,.1f} | {tiled / whole:.2f} |")


if __name__ == "__main__":
    main()
