"""Command-line entry points (main, reproduce, benchmark, ...)."""

import os

# LAPACK (FEDORA's subspace SVDs, a few small ones per run) goes through OpenBLAS. Its
# own threads made those 66x slower on a busy 2-core machine, and with one JAX CPU device
# per core (--cpu_devices) two devices may call it at once. Set before anything loads it;
# an explicit OPENBLAS_NUM_THREADS wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
