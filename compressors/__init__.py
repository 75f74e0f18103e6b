"""Compression algorithms, the packed formats they write and the kernels that serve them.

Each algorithm says what to compute from a layer and its calibration statistics; it never
loads a model or reads a file (the layer runner in `calibrate.runner` walks the model).
"""
