"""lmpress stages, CLI, artifact I/O and lineage, evaluation."""

import compressors  # noqa: F401  (selects Triton's backend before anything else imports triton)

__version__ = "0.1.0"
