"""lmpress stages, CLI, artifact I/O and lineage, evaluation."""

import os

# Two thread pools share the cores: torch's and the OpenBLAS that numpy and scipy load, which
# calibrate.stats.Moments calls for x^T x (syrk). OpenBLAS's threads spin after each call and
# the torch op that follows ran 2-3x slower for it; on 2 cores calibration took 26 s per 16
# windows with OpenBLAS on one thread, 49 s on two (and 32 s with OpenMP's threads asleep
# instead, which slowed torch's small ops: the levels stage 173 s against 112 s). Set before
# numpy loads it; a user's own setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# LMPRESS_QUIET hides lmpress's own bars; the libraries' tqdm bars (compressed-tensors'
# "Decompressing model") too, else an error after a load comes with lines of bars before it.
# tqdm reads its settings from the environment when it is imported.
if os.environ.get("LMPRESS_QUIET"):
    os.environ.setdefault("TQDM_DISABLE", "1")

import compressors  # noqa: E402, F401  (selects Triton's backend before anything else imports triton)

__version__ = "0.1.0"
