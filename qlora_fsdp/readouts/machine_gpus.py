"""This machine's GPUs (through NVML, as nvidia-smi reads them) and host RAM, which of them a launch uses
(CUDA_VISIBLE_DEVICES), and a sampler that follows a run: memory and utilisation sampled every half second and
kept as the peak of each training step, so that a peak between two of the page's looks is not lost."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

from qlora_fsdp.config import RECIPES_DIR

FAKE_NVML_ENV = "QLORA_FAKE_NVML"  # a JSON file of fake GPUs (FakeNvml): the tests' machine has none
GIB = 1024**3
SAMPLE_S = 0.5


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML's (PCI bus order): the launch sets CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA counts the same way
    name: str
    total_gib: float
    used_gib: float
    utilisation: float  # percent of the time a kernel ran over NVML's last sample period


@dataclass(frozen=True)
class Sample:
    gpus: tuple[Gpu, ...]
    host_total_gib: float
    host_used_gib: float


def peak(a: Sample | None, b: Sample) -> Sample:
    """Each GPU's and the host's larger reading of the two (a GPU one of them missed, in a failed read, kept)."""
    if a is None:
        return b
    gpus = {gpu.index: gpu for gpu in a.gpus}
    for gpu in b.gpus:
        before = gpus.get(gpu.index, gpu)
        gpus[gpu.index] = replace(gpu, used_gib=max(gpu.used_gib, before.used_gib),
                                  utilisation=max(gpu.utilisation, before.utilisation))
    return Sample(tuple(gpus[i] for i in sorted(gpus)), b.host_total_gib, max(a.host_used_gib, b.host_used_gib))


class FakeNvml:
    """Test double of the pynvml calls used here, for machines without an NVIDIA driver: the GPUs come from a JSON
    file read again at each call (a test rewrites it while the studio runs), {"gpus": [{"name", "total_gib",
    "used_gib", "utilisation"}]} (written whole: to a temporary file, then renamed), or {"error": "..."} for a
    machine whose NVML fails."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def gpus(self) -> list[dict[str, Any]]:
        data = json.loads(self.path.read_text())
        if "error" in data:
            raise RuntimeError(data["error"])
        return list(data["gpus"])

    def nvmlInit(self) -> None:  # pynvml's names
        self.gpus()

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return str(self.gpus()[handle]["name"])

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        gpu = self.gpus()[handle]
        total, used = int(gpu["total_gib"] * GIB), int(gpu["used_gib"] * GIB)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self.gpus()[handle]["utilisation"], memory=0)


def open_nvml() -> tuple[Any, str]:
    """NVML initialised (pynvml, or FakeNvml where QLORA_FAKE_NVML names a file), or None and why it failed."""
    fake = os.environ.get(FAKE_NVML_ENV)
    try:
        if fake:
            nvml: Any = FakeNvml(Path(fake))
        else:
            import pynvml  # imported here: the rest of the studio works where it is missing

            nvml = pynvml
        nvml.nvmlInit()
    except Exception as err:  # NVMLError_LibraryNotFound, DriverNotLoaded, ... on a machine without the driver
        return None, str(err) or type(err).__name__
    return nvml, ""


def read_gpus(nvml: Any) -> tuple[Gpu, ...]:
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = nvml.nvmlDeviceGetName(handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        busy = nvml.nvmlDeviceGetUtilizationRates(handle)
        gpus.append(Gpu(index, name.decode() if isinstance(name, bytes) else name,  # older pynvml: bytes
                        memory.total / GIB, memory.used / GIB, float(busy.gpu)))
    return tuple(gpus)


def host_ram_gib(meminfo: Path = Path("/proc/meminfo")) -> tuple[float, float]:
    """Host RAM (total, used): used is what is not available (page cache the kernel can drop counts as free)."""
    kib = {}
    for line in meminfo.read_text().splitlines():
        name, _, rest = line.partition(":")
        kib[name] = int(rest.split()[0]) if rest.split() else 0
    total = kib["MemTotal"] / 1024**2
    return total, total - kib.get("MemAvailable", kib.get("MemFree", 0)) / 1024**2


def cuda_visible_devices(indices: list[int]) -> dict[str, str]:
    """The environment that makes a child see only these GPUs, numbered as NVML (and this page) numbers them."""
    if any(index < 0 for index in indices):
        raise ValueError(f"GPU indices are 0 or more: {indices}")
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in sorted(set(indices))),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # CUDA's own default order (fastest first) can differ from NVML's


class Followed(Protocol):
    """A run the sampler follows: runs.Run, or run_folders.FollowedRun."""

    @property
    def output_dir(self) -> Path: ...

    @property
    def running(self) -> bool: ...


@dataclass
class StepReader:
    """The step a run is at, from its metrics.jsonl read from where the last read stopped (a long run's file is not
    parsed again every half second): the step after the last one logged, once the run has started (0 before: the
    model is loading)."""

    path: Path
    offset: int = 0
    started: bool = False
    last_step: int = 0

    def step(self) -> int:
        if not self.path.is_file():
            return 0
        with self.path.open("rb") as f:
            if os.fstat(f.fileno()).st_size < self.offset:  # a resume trimmed the file: read it again
                self.offset, self.started, self.last_step = 0, False, 0
            f.seek(self.offset)
            text = f.read()
        complete = text[:text.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            self.started = self.started or record.get("event") == "start"
            if isinstance(record.get("step"), int):
                self.last_step = record["step"]
        return self.last_step + 1 if self.started else 0


@dataclass
class HardwareMonitor:
    """NVML opened once; `follow(run)` samples in a thread until the run ends, `take()` gives what was seen."""

    interval_s: float = SAMPLE_S
    nvml: Any = None
    error: str = ""  # why NVML is not there
    peaks: dict[int, Sample] = field(default_factory=dict)  # the followed run's peak of each step
    since_take: Sample | None = None  # the peak since the page last looked
    samples: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None
    followed: Followed | None = None
    stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.nvml is None and not self.error:
            self.nvml, self.error = open_nvml()

    def sample(self) -> Sample:
        gpus: tuple[Gpu, ...] = ()
        if self.nvml is not None:
            try:
                gpus = read_gpus(self.nvml)
            except Exception as err:  # a GPU fallen off the bus, a fake file being rewritten: said, not raised
                self.error = str(err) or type(err).__name__
        return Sample(gpus, *host_ram_gib())

    def record(self, step: int) -> None:
        """One sample folded into `step`'s peak and the peak since the last look (the thread's body, once)."""
        now = self.sample()
        with self.lock:
            self.peaks[step] = peak(self.peaks.get(step), now)
            self.since_take = peak(self.since_take, now)
            self.samples += 1

    def take(self) -> tuple[Sample, dict[int, Sample]]:
        """The highest readings since the last take (a fresh sample where none was taken) and each step's peak."""
        with self.lock:
            seen, self.since_take = self.since_take, None
            peaks = dict(self.peaks)
        return seen if seen is not None else self.sample(), peaks

    def follow(self, run: Followed) -> None:
        """Sample `run` until it ends (a run already followed goes on; another one's peaks start afresh)."""
        if self.thread is not None and self.thread.is_alive():
            if self.followed is run:
                return
            self.close()
        with self.lock:
            self.peaks, self.since_take = {}, None
        self.followed, self.stopping = run, threading.Event()
        self.thread = threading.Thread(target=self.sample_until_ended, args=(run, self.stopping),
                                       name=f"hardware sampler {run.output_dir}", daemon=True)
        self.thread.start()

    def sample_until_ended(self, followed: Followed, stopping: threading.Event) -> None:
        steps = StepReader(followed.output_dir / "metrics.jsonl")
        while followed.running and not stopping.is_set():
            self.record(steps.step())
            stopping.wait(self.interval_s)

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def visible(self, chosen: list[int]) -> list[int] | None:
        """A launch's GPUs: the chosen ones; None (CUDA's default: all) where NVML found none to choose from."""
        return sorted(chosen) if self.nvml is not None and self.sample().gpus else None


def hardware_markdown(now: Sample, error: str) -> str:
    """The GPUs and host RAM as a Markdown table, or the one line that says why there is no GPU."""
    rows = ["| GPU | name | memory used | utilisation |", "|---|---|---|---|"]
    rows += [f"| {gpu.index} | {gpu.name} | {gpu.used_gib:.1f} / {gpu.total_gib:.1f} GiB | {gpu.utilisation:.0f}% |"
             for gpu in now.gpus]
    rows.append(f"| host | RAM | {now.host_used_gib:.1f} / {now.host_total_gib:.1f} GiB | |")
    if now.gpus:
        return "\n".join(rows)
    cpu = ", ".join(sorted(path.stem for path in RECIPES_DIR.glob("tiny_cpu*.yaml")))
    return f"no GPU found (NVML: {error or 'no device'}): the CPU recipes train here ({cpu})\n\n" + "\n".join(rows)
