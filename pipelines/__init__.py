"""lmpress stages, CLI, artifact I/O and lineage, evaluation."""

__version__ = "0.1.0"
