"""The recipe schema: one typed dataclass per section, every mode a `Literal` (checked once, at load)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# the objective and generation sections live in their own modules (config/__init__.py exports them)
from qlora_fsdp.config.generation import GenerationConfig
from qlora_fsdp.config.objectives import (
    OBJECTIVES,
    GrpoConfig,
    ObjectiveKind,
    ObjectiveName,
    PreferenceConfig,
    RlooConfig,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO_ROOT / "recipes"
FSDP_CONFIGS_DIR = REPO_ROOT / "fsdp_configs"

DType = Literal["bfloat16", "float16", "float32"]
# auto: bfloat16 on GPUs of compute capability 8.0+, float16 (with loss scaling) on older ones, float32 on a CPU
# without bf16 units (qlora_fsdp/precision.py); resolved once the device is known
DTypeChoice = Literal["auto", "bfloat16", "float16", "float32"]
AttnImplementation = Literal["auto", "sdpa", "sdpa_varlen", "eager", "flash_attention_2", "flex_attention"]


@dataclass
class ModelConfig:
    path: str = "models/tiny-llama"  # a local checkpoint folder, or a hub id where a network is there
    trust_remote_code: bool = False  # run the Python code a hub checkpoint ships (its own model classes)
    dtype: DTypeChoice = "auto"  # non-quantized weights (embeddings, norms, lm_head)
    init: Literal["pretrained", "random"] = "pretrained"  # random: seeded weights from config.json alone
    # auto: per-sample attention for packed rows (flash_attention_2 on CUDA where flash-attn is installed, else
    # sdpa_varlen), sdpa otherwise. With packing, sdpa and eager score whole rows under a dense block-diagonal
    # mask (exact, slower); flex_attention trains on CUDA only. See qlora_fsdp/layers/attention.py
    attn_implementation: AttnImplementation = "auto"
    allow_pickle: bool = False  # .bin/.pt weights can run code when unpickled; refused unless this is true
    # train a family that is not checked against transformers + bitsandbytes (docs/model-families.md's support
    # matrix); refused at load unless this is true, since its loss could differ silently
    unchecked_family: bool = False
    # a PEFT adapter folder to start from (an SFT run's `adapter/`), trained further with the recipe's LoRA
    # settings; under DPO, and GRPO with beta > 0, the reference is then the base plus this adapter, frozen
    adapter: str | None = None
    # tokens added to the tokenizer (a new language's, a chat format's markers); the embeddings and the head grow
    # to hold them where the checkpoint's vocabulary has no room, each new row the mean of the stored ones. Needs
    # lora.train_embeddings, which trains them
    add_tokens: list[str] = field(default_factory=list)


@dataclass
class QuantConfig:
    quant_type: Literal["nf4", "fp4"] = "nf4"  # the 4-bit code: nf4 (QLoRA's normal-float levels) or fp4
    double_quant: bool = True  # quantize the absmax too: ~0.13 instead of 0.5 extra bit per parameter
    compute_dtype: DTypeChoice = "auto"  # what the 4-bit weights are dequantized to
    blocksize: int = 64  # weights per absmax scale; a pre-quantized checkpoint's own must be given
    skip_modules: list[str] = field(default_factory=lambda: ["lm_head"])  # linears (by last name part) kept unquantized
    # a vision-language checkpoint's image side (vision tower and projector, frozen): `auto` makes 4-bit what
    # transformers + bitsandbytes make 4-bit for the family; `unquantized` keeps it all in the compute dtype (more
    # memory, the image features of the unquantized model)
    vision_tower: Literal["auto", "unquantized"] = "auto"


PISSA_FAST = "pissa_niter_"  # PEFT's name of PiSSA by randomized SVD with n subspace iterations: pissa_niter_4
LORA_INITS = ("default", "pissa", "olora", "loftq", "eva")  # lora.init's values besides pissa_niter_<n>


def changes_base(init: str) -> bool:
    """Whether lora.init moves part of each weight into the adapter (PiSSA, OLoRA, LoftQ; not EVA, which starts A
    from the data and leaves the base alone)."""
    return init not in ("default", "eva")


@dataclass
class LoraConfig:
    r: int = 16  # the rank of each LoRA update (A is r x in, B is out x r)
    alpha: int = 32  # the update is scaled by alpha/r (alpha/sqrt(r) with use_rslora)
    dropout: float = 0.0  # dropout on the LoRA input, in training only
    target_modules: str | list[str] = "all-linear"  # or a list such as [q_proj, v_proj]
    use_dora: bool = False  # DoRA: a trained magnitude per output row beside the LoRA direction
    use_rslora: bool = False  # rank-stabilized: scale the update by alpha/sqrt(r) instead of alpha/r
    # mixtures of experts: LoRA on every expert's matrices too (saved as PEFT's target_parameters), and the routers
    # trained in full (saved as PEFT's modules_to_save); by default only the attention and dense layers get LoRA
    target_experts: bool = False
    train_router: bool = False  # mixtures of experts: the routers trained in full (see target_experts)
    # a vision-language checkpoint with images in the data: its projector trained in full (kept unquantized, in
    # lora.dtype; saved as PEFT's modules_to_save)
    train_projector: bool = False
    # a vision-language checkpoint with images in the data: LoRA (this section's r and alpha) on its vision tower's
    # linears, 4-bit or not
    target_vision_tower: bool = False
    dtype: DType = "float32"  # trainable weights; fp32 keeps small updates from rounding away
    # q/k/v and gate/up, which read the same input: one cast of it and one matmul by their A matrices stacked
    fuse_projections: bool = True
    # the LoRA matmuls' dtype: `base` (the base layer's output dtype, bf16 on a GPU: the weights are cast down on
    # the way in, their gradients and the optimizer stay in lora.dtype), or `weights` (PEFT's: the input cast up
    # to lora.dtype). docs/benchmarks/speed.md: base was 1.17x faster for the same held-out loss
    compute_dtype: Literal["weights", "base"] = "base"
    # the input embeddings and the output head trained in full beside LoRA (unquantized, in lora.dtype; saved as
    # PEFT's modules_to_save): continued pretraining, a new language, new tokens (model.add_tokens)
    train_embeddings: bool = False
    embeddings_lr: float | None = None  # their learning rate (the schedule scales it as optim.lr); None: optim.lr
    # how A and B start: default (A random, B zero: the base unchanged), or an init that moves part of each weight
    # into the adapter and quantizes the rest, computed from the full-precision weights while they load: pissa (its
    # principal singular directions), pissa_niter_<n> (the same by randomized SVD, n iterations: much faster),
    # olora (QR), loftq (alternating 4-bit quantization and SVD of its error), saved as PEFT saves them: a plain
    # LoRA of rank 2r that applies to the original checkpoint. eva: A from the first micro-batches' layer inputs
    # (their top right-singular vectors, every rank's gathered; PEFT's EVA with rho 1), B zero, the base unchanged
    init: str = "default"
    loftq_iter: int = 1  # loftq: the alternations (PEFT's loftq_iter)
    # LoRA+: the B matrices (and trained vectors: DoRA's magnitudes, biases) learn at this multiple of optim.lr,
    # as PEFT's create_loraplus_optimizer groups them (the paper suggests 16); None: one learning rate
    plus_ratio: float | None = None


@dataclass
class FSDPConfig:
    reshard_after_forward: bool = True  # free gathered layers after forward; re-gather in backward
    cpu_offload: bool = False  # sharded params, grads and optimizer state live in host RAM
    param_dtype: DType | None = None  # None: compute in storage dtypes (the 4-bit storage is never cast)
    reduce_dtype: DType = "float32"  # the dtype gradients are reduced across ranks in
    # None: shard over all ranks; n: HSDP, shard within groups of n ranks (a node), replicate across the groups,
    # so the parameter all-gathers stay on the fast local links
    shard_size: int | None = None
    # context parallel: every row split over this many ranks (consecutive: the GPUs of a node), attention traded
    # across the split (Ulysses), so one rank holds 1/n of a row's activations; 1: whole rows a rank
    context_parallel: int = 1


CheckpointedLayers = Literal["every_layer", "every_nth", "first_last", "layers", "off"]
CheckpointScope = Literal["layer", "attention", "mlp", "ops"]


@dataclass
class ActivationCheckpointingConfig:
    """What backward recomputes instead of keeping: the one policy sharding applies, training runs and the
    planner measures. `mode` picks the layers, `scope` what inside each chosen layer is recomputed."""

    mode: CheckpointedLayers = "every_layer"  # which decoder layers are checkpointed (off: none)
    every_n: int = 2  # every_nth: layers 0, n, 2n, ... are checkpointed
    first_last: int = 1  # first_last: the first N and the last N layers are checkpointed
    layers: list[int] = field(default_factory=list)  # layers: these layer indices (0-based) are checkpointed
    # layer: the whole decoder layer (keeps only its input); attention / mlp: only that sub-layer (the other's
    # activations are kept); ops: the whole layer, but matmul and attention outputs are saved and only the
    # cheap element-wise ops are recomputed (torch's selective checkpointing)
    scope: CheckpointScope = "layer"
    offload: bool = False  # what checkpointing keeps (each layer's input) waits in host memory until backward
    # every layer's MLP runs over the row in tiles of this many tokens, in forward and in backward (0: whole rows):
    # its intermediate tensors, a layer's largest, then exist for one tile at a time (long rows)
    mlp_tile_tokens: int = 0
    # every layer's norms and attention projections (q/k/v/o with their LoRA, head norms) run over the row in tiles
    # of this many tokens (0: whole rows): their fp32 and LoRA intermediates exist for one tile at a time; the
    # attention kernel still sees the whole row
    attention_tile_tokens: int = 0

    def wraps(self, index: int, n_layers: int) -> bool:
        """Whether decoder layer `index` (of `n_layers`) is checkpointed."""
        if self.mode == "every_layer":
            return True
        if self.mode == "every_nth":
            return index % self.every_n == 0
        if self.mode == "first_last":
            return index < self.first_last or index >= n_layers - self.first_last
        if self.mode == "layers":
            return index in self.layers
        return False

    def wrapped_count(self, n_layers: int) -> int:
        return sum(self.wraps(index, n_layers) for index in range(n_layers))


@dataclass
class LossConfig:
    """The next-token cross-entropy. Chunked: the output projection and the loss run `chunk_tokens` tokens at a
    time and are recomputed in backward, so the full fp32 logits (tokens x vocabulary) never exist at once;
    the summed loss and its gradients are the full computation's (to float rounding)."""

    chunked: bool = True  # false: the full fp32 logits (tokens x vocabulary) at once
    chunk_tokens: int = 256  # tokens per chunk of the output projection and loss


@dataclass
class OptimConfig:
    name: str = "paged_adamw_8bit"  # a key of qlora_fsdp/optimizer_registry.py's registry
    lr: float = 2e-4  # the peak learning rate, reached after warmup
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay on the trained weights
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam's two moment decay rates
    eps: float = 1e-8  # Adam's denominator term
    max_grad_norm: float | None = 1.0  # None: no clipping
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"  # the decay after warmup
    warmup_steps: int = 0  # optimizer steps of linear warmup from 0 to lr
    warmup_ratio: float = 0.0  # or warmup as a fraction of train.max_steps (optimizer steps); not both
    min_lr_ratio: float = 0.1  # cosine/linear decay floor, as a fraction of lr
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"  # scale lr by (effective batch / lr_base_batch)
    lr_base_batch: int | None = None  # the effective batch (rows) that `lr` was tuned for
    # float16 compute only (a pre-Ampere GPU): the loss is multiplied by a scale that halves when a step's
    # gradients overflow (the step is skipped) and doubles after this many good steps in a row
    loss_scale_init: float = 65536.0
    loss_scale_growth_interval: int = 2000  # good steps in a row before the scale doubles


DataFormat = Literal["alpaca", "chat", "sharegpt", "text", "prompt"]  # prompt: GRPO's prompts (data/prompts.py)
TemplateChoice = Literal["auto", "tokenizer", "alpaca", "chatml"]  # what a recipe may ask for
Template = Literal["tokenizer", "alpaca", "chatml"]  # what a run renders with, once `auto` is decided
OverlongPolicy = Literal["truncate", "drop", "split"]


@dataclass
class SourceConfig:
    path: str = ""  # a JSON/JSONL/Parquet/CSV file, a folder of them, a save_to_disk folder, or a hub dataset id
    format: DataFormat = "alpaca"  # as data.format, for this source
    fields: dict[str, str] = field(default_factory=dict)  # our field name -> the data's, e.g. {output: response}
    weight: float = 1.0  # copies per epoch: 2.0 repeats the source, 0.5 takes a seeded half
    split: str = "train"  # for hub ids and save_to_disk dataset dicts
    subset: str | None = None  # a hub dataset's configuration, where it has several (openai/gsm8k: main)


@dataclass
class DataConfig:
    path: str = "data/tiny_instruct.jsonl"  # one source; or list several under `sources` (then path is unused)
    format: DataFormat = "alpaca"  # alpaca: instruction/input/output; chat: messages; sharegpt; text
    fields: dict[str, str] = field(default_factory=dict)  # our field name -> the data's, e.g. {output: response}
    sources: list[SourceConfig] = field(default_factory=list)  # several datasets mixed (data.sources[] below)
    eval_path: str | None = None  # a separate held-out set (same format); else eval_samples are held out
    # auto: the tokenizer's chat template where it has one, else alpaca for alpaca data and chatml for chats
    template: TemplateChoice = "auto"
    train_on_inputs: bool = False  # False: loss only on responses (every non-assistant turn masked)
    context_length: int = 256  # tokens per row (a sample, or a packed row)
    overlong: OverlongPolicy = "truncate"  # samples longer than context_length
    packing: bool = False  # several samples per row, attention kept within each sample
    group_by_length: bool = True  # without packing: similar lengths share a micro-batch (less padding)
    micro_batch_size: int | Literal["auto"] = 4  # rows per rank per forward; auto: the largest the planner fits
    grad_accum_steps: int = 1  # micro-batches per optimizer step; derived when an effective batch is set
    effective_batch: int | None = None  # rows (samples, or packed rows) per optimizer step over all ranks
    effective_batch_tokens: int | None = None  # the same in tokens: effective_batch = this / context_length
    eval_samples: int = 200  # held out (seeded), never trained on
    eval_batch_size: int = 16  # rows per forward when evaluating
    cache_dir: str | None = None  # tokenized-dataset cache; None: the datasets library's default
    num_proc: int = 1  # processes for tokenization
    # the dataset's size, for --plan's time of one epoch: its records (a local JSON-lines file's are counted) and,
    # with packing, their mean length in tokens (rows hold several records)
    records: int | None = None
    mean_record_tokens: float | None = None  # a record's mean length in tokens (with packing)
    # for --plan, a vision-language recipe: the images a row holds at most (the image side's memory, its forward and,
    # for Gemma 3, its masks); 0: text only. Training sees the images in the records themselves
    images_per_row: int = 0
    # a dynamic-resolution family's pixel budget per image (Qwen2.5-VL: a 28x28-pixel square is one token): an image
    # is resized to hold at least this many pixels; None: the checkpoint's processor's own
    image_min_pixels: int | None = None
    # and at most this many (589824, 768x768: a Qwen2.5-VL image at most 752 tokens); --plan counts each image at it
    image_max_pixels: int | None = None

    @property
    def micro_batch(self) -> int:
        """micro_batch_size as the number it is once run.batch_size.resolve_batch has run (every run, plan
        and trainer resolves the config before reading it)."""
        assert self.micro_batch_size != "auto", "micro_batch_size auto is resolved by run.batch_size.resolve_batch"
        return self.micro_batch_size


@dataclass
class TrainConfig:
    max_steps: int = 100  # optimizer steps to train for
    # sft: next-token loss on the targets; dpo, orpo, simpo: preference pairs, kto: records labelled desirable or
    # not (the `preference` section); reward: a reward model (a scalar head beside LoRA) on preference pairs; grpo:
    # rewards of generated completions (the `grpo` section)
    objective: ObjectiveName = "sft"
    eval_every: int = 0  # 0: evaluate only at start and end
    # steps a metrics.jsonl record (and a TensorBoard/W&B point) covers: their mean loss, summed tokens; eval steps,
    # checkpoints and a skipped step end one early
    log_every: int = 1
    seed: int = 42  # data order and held-out split, LoRA init, random init
    output_dir: str = "outputs/run"  # the run folder: metrics, checkpoints, the final adapter
    overwrite: bool = False  # an existing, non-empty output_dir is refused unless this is true
    save_every: int = 0  # steps between checkpoints; 0: only at the end and on SIGTERM/SIGINT
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted once a newer one is complete
    resume: str = "never"  # never | auto (latest complete checkpoint in output_dir, if any) | a checkpoint folder
    max_bad_steps: int = 5  # steps in a row with non-finite loss or gradients before the run stops
    collective_timeout_minutes: float = 60.0  # a rank waiting for the others (rank 0 tokenizing) stops after this
    # the first all-reduce, at start-up, must finish within this: broken GPU peer-to-peer access hangs it for good
    first_collective_timeout_s: float = 60.0
    # torch.compile each decoder layer: the graph breaks at the 4-bit matmuls and the rest (norms, rotary,
    # LoRA glue, activations, residuals) is fused: steps about 10% faster on CPU after a compile of about 50 s
    # (docs/benchmarks/speed.md), so it pays off on longer runs. On CPU it needs a C++ compiler
    compile: bool = False
    # NEFTune: uniform noise of +-alpha/sqrt(tokens x hidden) on the input embeddings in training forwards, as
    # transformers' Trainer adds it (the paper tried 5 to 15); None: off
    neftune_alpha: float | None = None

    @property
    def kind(self) -> ObjectiveKind:
        """What the objective is and needs (config/objectives.py's table)."""
        return OBJECTIVES[self.objective]

    def resume_target(self) -> Literal["never", "auto"] | Path:
        """`resume` as what it names: a mode, or a checkpoint folder."""
        if self.resume == "never":
            return "never"
        if self.resume == "auto":
            return "auto"
        return Path(self.resume)


@dataclass
class HardwareConfig:
    """What the recipe is planned for (`--plan`); training itself uses whatever torchrun gives it."""
    gpu: str = "cpu"  # a name in run.accelerators.GPUS (rtx4090, rtx3090, a100-80gb, h100, ...), or cpu
    gpus_per_node: int = 1  # ranks per node
    nodes: int = 1  # nodes (HSDP with fsdp.shard_size)
    gpu_memory_gib: float | None = None  # None: the table's figure for `gpu`
    host_ram_gib: float | None = None  # per node; None: not checked
    # what an optimizer step on offloaded shards streams host memory at, for --plan's step time (a desktop's
    # dual-channel DDR4/DDR5 peaks at 50-90 GB/s; one process's update reaches a fraction of it)
    host_memory_gbps: float = 20.0
    # the GPUs' PCIe slots, for --plan's step time; None: the card's own (`gpu`'s table entry). Two-GPU desktops
    # often run x8/x8, or a chipset slot at x4: FSDP's gathers then cross a quarter of the link
    pcie_gen: Literal[3, 4, 5] | None = None
    pcie_lanes: Literal[1, 2, 4, 8, 16] | None = None  # lanes per GPU slot (x16, x8, x4...)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class LoggingConfig:
    """metrics.jsonl is always written; these add to it."""
    tensorboard: bool = False  # event files in OUTPUT_DIR/tensorboard (needs `pip install tensorboard`)
    wandb: dict[str, Any] | None = None  # wandb.init arguments, e.g. {project: my-runs}; needs `pip install wandb`
    plot: bool = True  # OUTPUT_DIR/loss_curves.png at the end (training and held-out loss against step)


@dataclass
class ProfileConfig:
    memory: bool = False  # CUDA memory snapshot of the first `steps` steps: OUTPUT_DIR/profile/memory_rank{r}.pickle
    trace: bool = False  # torch.profiler trace of `steps` steps after one warm-up: profile/trace_rank{r}.json
    steps: int = 3  # steps profiled


# what `qlora-export` will write (its default --outtype): the llama.cpp types the forward trains through
ExportTarget = Literal["none", "q4_k_m", "q5_k_m", "q4_0", "q8_0"]


@dataclass
class ExportConfig:
    # the GGUF type this run will be exported as: the forward then computes with each merged weight as llama.cpp will
    # store it, gradients straight through (docs/after-training.md); none: train the 4-bit model as it is
    target: ExportTarget = "none"
    # its rounding: one Triton kernel on CUDA (auto; fused: refused elsewhere) or plain torch, to the same values
    rounding_kernel: Literal["auto", "fused", "torch"] = "auto"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    fsdp_preset: str = "full_shard"  # a file in fsdp_configs/, merged under `fsdp`
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    rloo: RlooConfig = field(default_factory=RlooConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    @property
    def several_samples_a_row(self) -> bool:
        """Rows hold several samples: packed ones, or a preference pair's two sequences side by side."""
        return self.data.packing or self.train.kind.pairs

    @property
    def multi_turn_rollouts(self) -> bool:
        """The objective's rollouts call tools (GRPO's tools and environments; validation refuses them elsewhere)."""
        return self.train.kind.generates and self.grpo.calls_tools

    @property
    def prompt_room(self) -> int:
        """A generating objective: the tokens a prompt may take; the rest of the context is its completion's."""
        return self.data.context_length - self.generation.max_completion_length

