"""Progress bars for long work (on stderr, so stdout stays clean for results)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

stderr = Console(stderr=True)


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[..., None]]:
    """Yield `advance(n=1)`; shows done/total, elapsed time and ETA. LMPRESS_QUIET=1 hides it."""
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("eta"), TimeRemainingColumn(), console=stderr, disable=bool(os.environ.get("LMPRESS_QUIET")),
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)
