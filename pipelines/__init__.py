"""lmpress stages, CLI, artifact I/O and lineage, evaluation."""

import os

# The stages mix torch's OpenMP threads with scipy's OpenBLAS ones (calibrate.stats.Moments sums
# x^T x with BLAS syrk), and OpenMP's default, spinning for a while after each parallel region,
# holds the cores OpenBLAS's threads then need: on 2 cores calibration ran 28% faster with
# waiting threads asleep, evaluation the same. OpenMP reads this once, when torch loads it; a
# user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import compressors  # noqa: E402, F401  (selects Triton's backend before anything else imports triton)

__version__ = "0.1.0"
