"""Transfer: copy a model between nodes and load an image file on a node (air-gapped clusters).

Bytes stream through the launcher's machine (read from one transport, written to the other) in
1 MiB chunks, so neither side needs to reach the other directly. An image file travels without
the layers the node already holds (image_file.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from llmctl.cluster.errors import ClusterError
from llmctl.cluster.launch import commands
from llmctl.cluster.launch.image_file import ImageFile, layers_held, write_thin
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


def node_layers(target: Transport) -> list[list[str]]:
    """The layer lists of every image the node's daemon holds (none when it cannot say)."""
    listed = target.run(commands.image_ids_argv())
    ids = sorted(set(listed.stdout.split())) if listed.ok else []
    if not ids:
        return []
    found = target.run(commands.image_layers_argv(ids))
    if not found.ok:
        return []
    return [json.loads(line) or [] for line in found.stdout.splitlines() if line.strip()]


def load_image_file(target: Transport, image: ImageFile) -> str:
    """Upload the `docker save` file to the node, `docker load` it there, remove the upload; only
    the layers the node lacks travel (image_file.py). Returns what was shipped, in words."""
    held = layers_held(image.layers, node_layers(target))
    total = len(image.layers)
    with tempfile.TemporaryDirectory(prefix="llmctl-image-") as tmp:
        upload = image.path if held == 0 else str(write_thin(image, held, Path(tmp) / "thin.tar"))
        try:
            _upload_and_load(target, upload, image.path)
        except ClusterError:
            if upload == image.path:
                raise
            # A daemon that reads every layer's file (containerd's image store): all of them.
            upload, held = image.path, 0
            _upload_and_load(target, upload, image.path)
        size = os.path.getsize(upload) / 1e6
    if held == total:
        return f"the manifest only, {size:,.1f} MB: the node held all {total} layers"
    if held:
        return f"{total - held} of {total} layers, {size:,.0f} MB: the node held the others"
    return f"all {total} layers, {size:,.0f} MB"


def _upload_and_load(target: Transport, upload: str, image_file: str) -> None:
    # The host in the name: nodes that share a home directory upload side by side.
    remote = f"{target.home()}/.llmctl/images/{target.name}-{os.path.basename(image_file)}"
    target.makedirs(os.path.dirname(remote))
    copy_file(LocalTransport(), upload, target, remote)
    try:
        check(
            target.run(commands.docker_load_argv(remote), timeout=1800),
            target.name,
            f"docker load of {image_file}",
        )
    finally:
        target.run(["rm", "-f", "--", remote])
