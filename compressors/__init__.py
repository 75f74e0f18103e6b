"""Compression algorithms, the packed formats they write and the kernels that serve them.

Each algorithm says what to compute from a layer and its calibration statistics; it never
loads a model or reads a file (the layer runner in `calibrate.runner` walks the model).
"""

import os
import sys


def _select_triton_backend() -> None:
    """Without a GPU, Triton runs kernels only in its interpreter, and whichever module imports
    `triton.language` first fixes how its standard library is built (bitsandbytes and
    transformers import it early), so the choice is made when lmpress is imported."""
    if "TRITON_INTERPRET" in os.environ or "triton.language" in sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_select_triton_backend()
