"""The test suite (tests/README.md). Imported before any test module, so before torch."""

import os

# inductor compiles a graph's kernels in this process, not in a pool of fresh interpreters (one a core, each importing
# torch: 2 on a 2-core machine, in the test process and in every pool rank that compiles); the same kernels. Read when
# torch._inductor.config is imported, so it is set here; the rank pool's workers and subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
