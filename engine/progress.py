"""Rich progress bars for weight loading and batch generation, on stderr."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

ProgressFn = Callable[[int, int, str], None]


@contextmanager
def rich_progress(transient: bool = True) -> Iterator[ProgressFn]:
    """Yields progress(done, total, description): one bar per description."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=transient) as progress:
        tasks: dict[str, int] = {}

        def update(done: int, total: int, description: str) -> None:
            if description not in tasks:
                tasks[description] = progress.add_task(description, total=total or None)
            progress.update(tasks[description], completed=done, total=total or None)

        yield update
