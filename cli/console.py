"""What the user sees on the terminal: rich consoles, engine log lines, the error report.

Results go to stdout; log lines, progress bars and errors go to stderr, so
`llmctl generate --json ... > out.json` stays machine-readable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import click
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.text import Text

from llmctl.engine.errors import LLMCtlError
from llmctl.engine.progress import stderr_console as engine_stderr_console

_LOGGER_NAME = "llmctl"  # the engine's logger


@dataclass(frozen=True)
class CliState:
    """Global options, handed from the root callback to every command as ctx.obj."""

    debug: bool = False
    progress: bool = True  # rich progress bars while weights load and while a batch generates


def stdout_console() -> Console:
    # Console resolves sys.stdout when it writes, so CliRunner's captured streams work too.
    return Console(highlight=False, emoji=False)


def stderr_console() -> Console:
    return engine_stderr_console()


def configure_logging(level: int) -> None:
    """Show the engine's log records (logger "llmctl") at `level` and above on stderr: rich
    lines on a terminal, plain unwrapped `LEVEL message` lines in a file or pipe.

    Replaces the handler a previous call installed, so repeated invocations in one process (tests)
    do not print each line twice.
    """
    logger = logging.getLogger(_LOGGER_NAME)
    for handler in list(logger.handlers):
        if isinstance(handler, _CliHandler):
            logger.removeHandler(handler)
    console = stderr_console()
    if console.is_terminal:
        handler = _CliLogHandler(console=console, show_time=False, show_path=False, markup=False)
    else:
        handler = _PlainHandler(console.file)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)


class _CliHandler:
    """Marks the handlers configure_logging installs, so they can be found again."""


class _CliLogHandler(_CliHandler, RichHandler):
    pass


class _PlainHandler(_CliHandler, logging.StreamHandler):
    pass


def print_error(exc: LLMCtlError, traceback: bool = False) -> None:
    """Report an error on stderr: `error: <message>` in red, then `hint: <hint>` if it has one."""
    console = stderr_console()
    if traceback:
        console.print_exception(suppress=[click, typer])
    console.print(Text.assemble(("error: ", "bold red"), (exc.message, "red")), soft_wrap=True)
    if exc.hint:
        console.print(Text.assemble(("hint: ", "bold yellow"), exc.hint), soft_wrap=True)
