"""The test suite (tests/README.md). Imported before any test module, so before torch."""

import os

# inductor compiles a graph's kernels in this process, not in a pool of fresh interpreters (one a core, each importing
# torch: 2 on a 2-core machine, in the test process and in every pool rank that compiles); the same kernels. Read when
# torch._inductor.config is imported, so it is set here; the rank pool's workers and subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# one OpenMP thread in the test process too (ranks, torchrun's ranks and the planners already run one): the other
# core runs the background jobs and the second rank, and a second thread here spins between the tiny models' small
# ops. The in-process lane took 11% less CPU time at the same wall time (49.2 -> 43.8 s, 2026-11-26).
os.environ.setdefault("OMP_NUM_THREADS", "1")
