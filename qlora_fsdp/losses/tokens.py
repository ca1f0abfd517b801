"""The summed next-token cross-entropy of a batch whose labels are already shifted; chunked, the full logits
never exist at once.

Full: logits for every token (tokens x vocabulary, in the compute dtype, plus an fp32 copy, the log-softmax
and their gradients: 3.9 GiB for 2,048 tokens of Llama 3's 128k vocabulary). Chunked: the model returns its
final hidden states instead (the output layer sees an empty slice), then the output layer and the loss run
`chunk_tokens` tokens at a time, each chunk checkpointed so backward recomputes its logits; only one chunk's
logits are alive at any moment, and only target tokens are run through it. Same sum, in a different order:
equal to float rounding.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from qlora_fsdp.families import softcaps_logits
from qlora_fsdp.labels import IGNORE_INDEX

# an objective's weight for each target token's loss, from those losses (no gradient flows through a weight)
TokenWeight = Callable[[torch.Tensor], torch.Tensor]


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, weight: TokenWeight | None = None) -> torch.Tensor:
    """Summed fp32 cross-entropy of the target tokens (labels are pre-shifted); with `weight`, each token's loss
    times its weight (0 at ignored positions either way)."""
    flat_logits, flat_labels = logits.flatten(0, -2).float(), labels.flatten()
    if weight is None:
        return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    losses = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="none")
    return (losses * weight(losses.detach())).sum()


def head_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    # a plain Linear head runs as its function: calling the module again after the model's forward would look
    # to module-level memory trackers (torch's MemTracker, the planner's measured step) like a second forward
    # (a trained head, lora.train_embeddings, holds its weights in lora.dtype: the input is cast up to them)
    return F.linear(hidden.to(head.weight.dtype), head.weight, head.bias) if type(head) is nn.Linear else head(hidden)


def head_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
              weight: TokenWeight | None = None) -> torch.Tensor:
    logits = head_logits(head, hidden)
    return cross_entropy_sum(logits, labels, weight)


@contextmanager
def hidden_states_instead_of_logits(head: nn.Module) -> Iterator[None]:
    """For one forward: the output layer computes nothing (an empty slice of tokens) and its output, hence the
    model's `logits`, is the final hidden states. Going through the model's own forward keeps FSDP's hooks
    (the root's gather, its backward hooks on the output) exactly as in the full loss."""
    kept: list[torch.Tensor] = []

    def empty_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        kept.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    def hidden_output(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return kept.pop()

    handles = [head.register_forward_pre_hook(empty_input), head.register_forward_hook(hidden_output)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def post_processes_logits(model: nn.Module) -> bool:
    """Models that transform the head's output inside their forward (Gemma 2's soft-capping) would transform
    the hidden states handed back in its place, so they take the full loss."""
    return softcaps_logits(getattr(model, "config", None))


def target_hidden_states(model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor,
                         targets: torch.Tensor | None) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(the output layer, the final hidden states, the labels), flat and at the target tokens only where
    `targets` is given: the model's forward without its output layer."""
    # nn.Module types every attribute as Tensor | Module; a causal LM's method it is
    head = cast(Callable[[], nn.Module | None], model.get_output_embeddings)()
    assert isinstance(head, nn.Module), "a causal LM has an output layer"
    with hidden_states_instead_of_logits(head), warnings.catch_warnings():
        # FSDP2 warns that the root returned a view (the head's input slice), since an in-place op on it would skip
        # its backward hook; nothing here changes it in place
        warnings.filterwarnings("ignore", message=".*returned a view tensor", category=UserWarning)
        hidden = model(**inputs).logits
    hidden, labels = hidden.flatten(0, 1), labels.flatten()
    if targets is not None:
        hidden, labels = hidden.index_select(0, targets), labels.index_select(0, targets)
    return head, hidden, labels


def summed_loss(model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, chunk_tokens: int | None,
                targets: torch.Tensor | None = None, weight: TokenWeight | None = None) -> torch.Tensor:
    """Summed cross-entropy over the target tokens (each weighted by `weight`, where given); chunked when
    `chunk_tokens` is set (and the model allows). `targets` (flat indices of the target tokens): the chunked loss
    runs the output layer on those alone, as the other positions add nothing to the sum (prompts, padding: often
    half the tokens or more)."""
    if chunk_tokens is None or post_processes_logits(model):
        return cross_entropy_sum(model(**inputs).logits, labels, weight)
    head, hidden, labels = target_hidden_states(model, inputs, labels, targets)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():  # backward recomputes this chunk's logits instead of keeping them
            total = total + checkpoint(head_loss, head, hidden[part], labels[part], weight, use_reentrant=False)
        else:
            total = total + head_loss(head, hidden[part], labels[part], weight)
    return total


def per_sample_sums(losses: torch.Tensor, samples: torch.Tensor, n_samples: int) -> torch.Tensor:
    return losses.new_zeros(n_samples).index_add(0, samples, losses)


def head_sample_losses(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, samples: torch.Tensor,
                       n_samples: int) -> torch.Tensor:
    logits = head_logits(head, hidden)
    losses = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return per_sample_sums(losses, samples, n_samples)


def per_sample_loss(model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, chunk_tokens: int | None,
                    targets: torch.Tensor, samples: torch.Tensor, n_samples: int) -> torch.Tensor:
    """Each sample's summed cross-entropy (minus the log-probability of its targets given what precedes them), a
    vector of `n_samples`: `samples[i]` is the sample of target position `targets[i]`. Chunked as summed_loss."""
    if chunk_tokens is None or post_processes_logits(model):
        logits = model(**inputs).logits.flatten(0, -2).index_select(0, targets)
        losses = F.cross_entropy(logits.float(), labels.flatten().index_select(0, targets),
                                 ignore_index=IGNORE_INDEX, reduction="none")
        return per_sample_sums(losses, samples, n_samples)
    head, hidden, labels = target_hidden_states(model, inputs, labels, targets)
    total = hidden.new_zeros(n_samples, dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            total = total + checkpoint(head_sample_losses, head, hidden[part], labels[part], samples[part],
                                       n_samples, use_reentrant=False)
        else:
            total = total + head_sample_losses(head, hidden[part], labels[part], samples[part], n_samples)
    return total


def logps_and_entropies(logits: torch.Tensor, labels: torch.Tensor,
                        temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's log-probability of its label and (no gradient: it is logged, never trained on) the entropy
    of its next-token distribution, from the logits divided by `temperature`."""
    scaled = logits.float() / temperature
    logps = -F.cross_entropy(scaled, labels, reduction="none")
    with torch.no_grad():
        log_probs = scaled.log_softmax(-1)
        entropies = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropies


def head_target_logps(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    return logps_and_entropies(head_logits(head, hidden), labels, temperature)


def target_logps(model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, chunk_tokens: int | None,
                 targets: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target | what precedes it) at each target position (targets' order), from the logits divided by
    `temperature` (GRPO scores completions at the temperature it sampled them at), and the entropy there (for the
    log, no gradient). Chunked as summed_loss."""
    if chunk_tokens is None or post_processes_logits(model):
        logits = model(**inputs).logits.flatten(0, -2).index_select(0, targets)
        return logps_and_entropies(logits, labels.flatten().index_select(0, targets), temperature)
    head, hidden, labels = target_hidden_states(model, inputs, labels, targets)
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            parts.append(checkpoint(head_target_logps, head, hidden[part], labels[part], temperature,
                                    use_reentrant=False))
        else:
            parts.append(head_target_logps(head, hidden[part], labels[part], temperature))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat([logps for logps, _ in parts]), torch.cat([entropies for _, entropies in parts])
