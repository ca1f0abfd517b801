"""Activation offload: what autograd keeps for backward waits in host memory until backward asks for it.

Entered around forward and loss, saved-tensor hooks see what the graph keeps. Under non-reentrant activation
checkpointing that is each checkpointed layer's positional inputs (torch 2.11 to 2.13 save them with
`_make_saved_tensor` before entering checkpoint's own hooks, so they pass through ours) plus whatever the
non-checkpointed code saves; the tensors inside a checkpointed region go through checkpoint's inner hooks and
never reach these. So the offloader moves exactly what checkpointing keeps, and frees its device memory.

On CUDA the copies run on a side stream into pinned memory and backward's next need is copied back while the
current one is used; on any other device (the CPU test mesh) the same steps run synchronously.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef


@dataclass
class OffloadStats:
    """Counters of one step (`ActivationOffloader.reset` starts a new one); bytes are the tensors' own sizes."""

    offloaded: int = 0  # tensors copied to host
    offloaded_bytes: int = 0
    deduplicated: int = 0  # saves answered by an earlier copy of the very same tensor
    restored: int = 0  # offloaded tensors brought back to the device (each counted once)
    prefetched: int = 0  # restores whose copy was started ahead of the request
    host_bytes: int = 0  # host copies alive now (autograd frees them with the graph)
    peak_host_bytes: int = 0

    def hold(self, nbytes: int) -> None:
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def release(self, nbytes: int) -> None:
        self.host_bytes -= nbytes


class _Saved:
    """What autograd holds instead of an offloaded tensor: its host copy, and the copies in flight."""

    def __init__(self, host: torch.Tensor, device: torch.device, previous: _Saved | None) -> None:
        self.host = host
        self.device = device
        # the tensor packed just before this one is, in reverse order, the next one backward needs
        self.previous = weakref.ref(previous) if previous is not None else None
        self.source: torch.Tensor | None = None  # the device original, held until its copy out completes
        self.version = 0
        self.copied: torch.cuda.Event | None = None
        self.ready: torch.Tensor | None = None  # a copy back started ahead of the request
        self.ready_event: torch.cuda.Event | None = None
        self.restored = False
        self.torn = False

    def copied_out(self) -> None:
        """The copy out has completed: let the device original go (its memory is what offloading frees)."""
        self.torn = self.source is not None and self.source._version != self.version
        self.source = None

    def check_unmodified(self) -> None:
        """An in-place change while the copy out was in flight may have torn it (autograd refuses such changes
        to saved tensors without hooks; with hooks it cannot see them)."""
        if self.torn or (self.source is not None and self.source._version != self.version):
            raise RuntimeError("a tensor saved for backward was modified in place while being offloaded")

    def before(self) -> _Saved | None:
        return self.previous() if self.previous is not None else None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _empty_dense(like: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """An empty tensor for `like`'s values: its strides where they tile its elements exactly (a transpose keeps
    its layout), contiguous otherwise (a slice is stored without the rest of its base)."""
    strides = torch.empty_like(like, device="meta").stride()  # empty_like's preserve_format rule, no allocation
    return torch.empty_strided(like.shape, strides, dtype=like.dtype, device=device, pin_memory=pin)


class ActivationOffloader:
    """Offloads tensors autograd saves during `offloading()` to host memory and brings them back in backward.

    Usage: `with offloader.offloading(): loss = forward_and_loss()`, then `loss.backward()` outside the block.
    Skipped (kept as they are): parameters and their views (FSDP2's unsharded ones too), tensor subclasses, tensors
    not on `device`, tensors under `min_bytes`, and broadcast views that would grow when copied.
    `host_device` stands in for host memory (e.g. `meta` for a planner running under FakeTensorMode)."""

    def __init__(self, device: torch.device | str, min_bytes: int = 2**16,
                 host_device: torch.device | str | None = None) -> None:
        self.device = torch.device(device)
        self.host_device = torch.device(host_device if host_device is not None else "cpu")
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        # a side stream lets copies overlap compute; only CUDA has one (and pinned memory) to use
        async_copies = self.device.type == "cuda" and self.host_device.type == "cpu" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(self.device) if async_copies else None
        self._in_flight: deque[_Saved] = deque()  # copies out whose device originals are still held, in order
        self._seen: dict[tuple[Any, ...], weakref.ref[_Saved]] = {}  # this forward's copies, for dedupe
        self._last: _Saved | None = None

    def reset(self) -> None:
        """New counters for a new step; host copies still alive stay counted in host_bytes."""
        held = self.stats.host_bytes
        for field in fields(self.stats):
            setattr(self.stats, field.name, 0)
        self.stats.host_bytes = self.stats.peak_host_bytes = held

    @contextmanager
    def offloading(self) -> Iterator[OffloadStats]:
        """Offload what autograd saves inside the block; the restores happen in the backward that follows."""
        self._last = None
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self.stats
        finally:
            self._seen.clear()  # dedupe spans one forward: its keys include version counters of that forward
            self._last = None
            self._retire()

    # ---- forward: pack -------------------------------------------------------------------------------------

    def _keeps(self, tensor: torch.Tensor) -> bool:
        """True for tensors left to autograd as they are."""
        # parameters and their views (the `weight.t()` a linear saves) are held by the model anyway; FSDP2's
        # unsharded parameters are nn.Parameter too
        return (isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)
                or type(tensor) not in (torch.Tensor, FakeTensor)  # subclasses own their storage (DTensor, ...)
                or tensor.layout != torch.strided
                or not self._on_device(tensor)  # already elsewhere (e.g. FSDP2's host-offloaded shards)
                or _nbytes(tensor) < self.min_bytes  # a copy would cost more than it frees
                or tensor.numel() == 0  # frees nothing (torch 2.11's checkpoint saves one with each block's inputs)
                or _nbytes(tensor) > tensor.untyped_storage().nbytes())  # a broadcast view would grow

    def _on_device(self, tensor: torch.Tensor) -> bool:
        same_type = tensor.device.type == self.device.type
        return same_type and (self.device.index is None or tensor.device.index == self.device.index)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Saved:
        if self._keeps(tensor):
            return tensor
        self._retire()
        key = (StorageWeakRef(tensor.untyped_storage()), tensor.storage_offset(), tuple(tensor.shape),
               tensor.stride(), tensor.dtype, tensor._version)
        earlier = self._seen.get(key)
        saved = earlier() if earlier is not None else None
        if saved is not None:  # e.g. the same rotary table handed to every layer: one copy, shared
            self.stats.deduplicated += 1
            return saved
        saved = self._offload(tensor)
        self._seen[key] = weakref.ref(saved)  # the key's weak storage ref pins the address: no false match
        return saved

    def _offload(self, tensor: torch.Tensor) -> _Saved:
        if self._stream is not None:  # the copy out must follow the kernels that produced the tensor
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        host, copied = self._copy(tensor.detach(), self.host_device, pin=self._stream is not None)
        saved = _Saved(host, tensor.device, self._last)
        if copied is not None:  # keep the original until the copy has read it
            saved.source, saved.version, saved.copied = tensor.detach(), tensor._version, copied
            self._in_flight.append(saved)
        nbytes = _nbytes(host)
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += nbytes
        self.stats.hold(nbytes)
        weakref.finalize(saved, self.stats.release, nbytes)
        self._last = saved
        return saved

    def _copy(self, src: torch.Tensor, device: torch.device, pin: bool) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A copy of src on `device`, and the side-stream event that completes it (None: already complete)."""
        if self._stream is None:
            dst = _empty_dense(src, device, pin=False)
            dst.copy_(src)
            return dst, None
        with torch.cuda.stream(self._stream):  # allocated on the side stream: record_stream on use elsewhere
            dst = _empty_dense(src, device, pin)
            dst.copy_(src, non_blocking=True)
            return dst, self._stream.record_event()

    def _retire(self) -> None:
        """Drop device originals whose copies out have completed, so their memory really goes."""
        while self._in_flight and self._in_flight[0].copied is not None and self._in_flight[0].copied.query():
            self._in_flight.popleft().copied_out()

    # ---- backward: unpack ----------------------------------------------------------------------------------

    def _unpack(self, packed: torch.Tensor | _Saved) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        self._retire()
        tensor = self._restore(packed)
        self._prefetch(packed.before())  # copy backward's next need while this one is used
        return tensor

    def _restore(self, saved: _Saved) -> torch.Tensor:
        saved.check_unmodified()
        if not saved.restored:
            saved.restored = True
            self.stats.restored += 1
        if saved.source is not None:  # its copy out is still in flight: the original is still here
            return saved.source
        if saved.ready is None:
            saved.ready, saved.ready_event = self._copy(saved.host, saved.device, pin=False)
        else:
            self.stats.prefetched += 1
        tensor, event, saved.ready, saved.ready_event = saved.ready, saved.ready_event, None, None
        assert tensor is not None
        if event is not None:  # the compute stream waits for the copy, and the allocator for the compute stream
            current = torch.cuda.current_stream(tensor.device)
            current.wait_event(event)
            tensor.record_stream(current)
        return tensor

    def _prefetch(self, saved: _Saved | None) -> None:
        """Start copying back a tensor not restored yet (a shared one restored before needs no head start)."""
        if saved is not None and not saved.restored and saved.ready is None and saved.source is None:
            saved.ready, saved.ready_event = self._copy(saved.host, saved.device, pin=False)
