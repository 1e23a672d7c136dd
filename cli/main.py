"""The `llmctl` command: sub-apps joined here; one exit path for every error.

Every LLMCtlError raised by a command ends in `_RootGroup.invoke`: one red `error:` line and a
`hint:` line on stderr, exit code 1 (`--debug` prints the traceback first). Click's usage errors
keep their exit code 2. Only typer and rich load at startup; commands import the engine lazily, so
`llmctl --help` and `llmctl --version` never import torch.
"""

from __future__ import annotations

import enum
import logging
from importlib.metadata import version
from typing import Annotated, Any

import click
import typer
from typer.core import TyperGroup

from llmctl.cli import bench, cluster, doctor, generate, image, plan, serve
from llmctl.cli.console import CliState, configure_logging, print_error
from llmctl.engine.errors import LLMCtlError

EXIT_ERROR = 1  # every LLMCtlError; Click's usage errors exit with 2


class LogLevel(enum.StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class _RootGroup(TyperGroup):
    """The root command; its invoke() wraps every subcommand, so it is the one exit path."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LLMCtlError as exc:
            print_error(exc, traceback=bool(ctx.params.get("debug")))
            raise typer.Exit(EXIT_ERROR) from None


app = typer.Typer(
    name="llmctl",
    cls=_RootGroup,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
app.add_typer(generate.app)
app.add_typer(serve.app)
app.add_typer(plan.app)
app.add_typer(cluster.app)
app.add_typer(image.app)
app.add_typer(doctor.app)
app.add_typer(bench.app)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"llmctl {version('llmctl')}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    version_: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback of an error, not just its message.")
    ] = False,
    log_level: Annotated[
        LogLevel,
        typer.Option("--log-level", case_sensitive=False, help="Engine log lines shown on stderr."),
    ] = LogLevel.info,
    quiet: Annotated[
        bool,
        typer.Option("--quiet", "-q", help="Only warnings and errors on stderr; no progress bars."),
    ] = False,
) -> None:
    """Plan, launch and serve large language models; run the bundled inference engine."""
    level = logging.WARNING if quiet else logging.getLevelNamesMapping()[log_level.value.upper()]
    configure_logging(level)
    ctx.obj = CliState(debug=debug, progress=not quiet)


def main() -> None:
    """Console script entry point (`llmctl`).

    LLMCtlError is caught inside `app`, by its root group, so tests that invoke `app` with
    CliRunner go through the same exit path as the console script.
    """
    app(prog_name="llmctl")
