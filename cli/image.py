"""`llmctl image build`: the container image of a cluster's nodes (templates/Dockerfile)."""

from __future__ import annotations

import shlex
from typing import Annotated

import typer

from llmctl.cli.console import stderr_console, stdout_console

app = typer.Typer(name="image", help="Build the llmctl container image.")


@app.command()
def build(
    tag: Annotated[str, typer.Option(help="The image's name:tag.")] = "llmctl:latest",
    target: Annotated[
        str, typer.Option(help="cpu (slim Python base) or cuda (CUDA base).")
    ] = "cpu",
    base_image: Annotated[
        str | None, typer.Option(help="Another base image (it must have Python >= 3.11).")
    ] = None,
    debootstrap: Annotated[
        bool,
        typer.Option(
            "--debootstrap", help="cpu: build the Debian base locally (no registry needed)."
        ),
    ] = False,
    no_ray: Annotated[
        bool,
        typer.Option(
            "--no-ray",
            help="Leave Ray out: a smaller image, for `llmctl cluster up --backend mp`.",
        ),
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Build even when up to date.")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the build commands; build nothing.")
    ] = False,
) -> None:
    """Build the llmctl image; skipped when the image already holds these sources."""
    from pathlib import Path

    from llmctl.cluster.launch.image import (
        ImageBuild,
        build_image,
        docker_build_argv,
        source_hash,
        source_root,
        wheel_argv,
    )

    spec = ImageBuild(
        tag=tag, target=target, base_image=base_image, debootstrap=debootstrap, ray=not no_ray
    )
    console = stdout_console()
    if dry_run:
        root = source_root()
        context = Path("CONTEXT")
        console.print(
            shlex.join(wheel_argv(spec, root, context / "deps")), markup=False, soft_wrap=True
        )
        argv = docker_build_argv(spec, context, source_hash(root))
        console.print(shlex.join(argv), markup=False, soft_wrap=True)
        return
    log = lambda line: stderr_console().print(f"[dim]{line}[/dim]")  # noqa: E731
    digest, built = build_image(spec, force=force, log=log)
    state = "built" if built else "up to date"
    ray = "with Ray" if spec.ray else "without Ray"
    console.print(f"{tag}: {state} (sources {digest}, base {spec.base}, {ray})")
