"""What the engine shows on stderr: rich progress bars (while weights load, while a batch
generates) and, for a library caller that configured no logging, its log lines.

Bars draw only on a terminal; redirected to a file or CI log they print nothing. The console
writes to whatever sys.stderr is when it writes, so log lines emitted under a live bar (through a
handler on the same kind of console) print above it instead of tearing it.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ProgressFn = Callable[[int, int, str], None]


class CurrentStderr(io.TextIOBase):
    """A file that writes to the current sys.stderr (a live bar redirects it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()

    def fileno(self) -> int:
        return sys.stderr.fileno()


def stderr_console():
    from rich.console import Console

    return Console(file=CurrentStderr(), highlight=False, emoji=False)


def configure_default_logging() -> None:
    """Show the engine's INFO lines (logger "llmctl": the KV-cache size, the maximum concurrency)
    on stderr, as vLLM's LLM does, unless the program configured logging itself (a handler on
    "llmctl" or on the root logger: the CLI's, pytest's) or LLMCTL_CONFIGURE_LOGGING=0."""
    import logging

    from llmctl.engine import envs

    logger = logging.getLogger("llmctl")
    if not envs.LLMCTL_CONFIGURE_LOGGING or logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(CurrentStderr())
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S")
    )
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


@contextmanager
def rich_progress() -> Iterator[ProgressFn]:
    """Yields progress(done, total, description): one bar per description."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = stderr_console()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(
        *columns, console=console, transient=True, disable=not console.is_terminal
    ) as bar:
        tasks: dict[str, int] = {}

        def update(done: int, total: int, description: str) -> None:
            if description not in tasks:
                tasks[description] = bar.add_task(description, total=total or None)
            bar.update(tasks[description], completed=done, total=total or None)

        yield update


@contextmanager
def generation_progress(enabled: bool, total: int) -> Iterator[Callable]:
    """Yields advance(request_output): one step per finished request, with tokens/s."""
    console = stderr_console()
    if not enabled or total == 0 or not console.is_terminal:
        yield lambda output: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("Processed prompts"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[rate]}"),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("generate", total=total, rate="")
        start = bar.get_time()
        generated = 0

        def advance(output) -> None:
            nonlocal generated
            generated += sum(len(c.token_ids) for c in output.outputs)
            rate = generated / max(bar.get_time() - start, 1e-9)
            bar.update(task, advance=1, rate=f"{rate:.1f} toks/s")

        yield advance
