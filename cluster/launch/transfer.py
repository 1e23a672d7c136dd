"""Transfer: copy a model between nodes and load an image file on a node (air-gapped clusters).

Bytes stream through the launcher's machine (read from one transport, written to the other) in
1 MiB chunks, so neither side needs to reach the other directly.
"""

from __future__ import annotations

import os
import shutil

from llmctl.cluster.launch import commands
from llmctl.cluster.launch.transport import LocalTransport, Transport, check

CHUNK = 1 << 20


def copy_file(source: Transport, src: str, target: Transport, dst: str) -> None:
    """Copy one file; the copy appears under its final name only when complete."""
    partial = f"{dst}.llmctl-partial"
    with source.open(src, "rb") as fin, target.open(partial, "wb") as fout:
        if hasattr(fout, "set_pipelined"):
            fout.set_pipelined(True)  # SFTP: do not wait for each write's acknowledgement
        shutil.copyfileobj(fin, fout, CHUNK)
    check(target.run(["mv", "-f", "--", partial, dst]), target.name, f"renaming {partial}")


def copy_model(source: Transport, target: Transport, model: str, files: dict[str, int]) -> int:
    """Copy a model (a directory's top-level files, or one file) to the same path on target."""
    is_file = len(files) == 1 and os.path.basename(model.rstrip("/")) in files
    if is_file:
        target.makedirs(os.path.dirname(model.rstrip("/")))
        copy_file(source, model, target, model)
    else:
        target.makedirs(model)
        for name in sorted(files):
            copy_file(source, f"{model.rstrip('/')}/{name}", target, f"{model.rstrip('/')}/{name}")
    return sum(files.values())


def load_image_file(target: Transport, image_file: str) -> str:
    """Upload a `docker save` file to the node, `docker load` it there, remove the upload."""
    # The host in the name: nodes that share a home directory upload side by side.
    remote = f"{target.home()}/.llmctl/images/{target.name}-{os.path.basename(image_file)}"
    target.makedirs(os.path.dirname(remote))
    copy_file(LocalTransport(), image_file, target, remote)
    try:
        result = check(
            target.run(commands.docker_load_argv(remote), timeout=1800),
            target.name,
            f"docker load of {image_file}",
        )
    finally:
        target.run(["rm", "-f", "--", remote])
    return result.stdout.strip()
