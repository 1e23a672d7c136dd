"""A `docker save` file, read for what `cluster up --image-file` uploads: the image's layers, and a
thin copy without the ones a node already holds.

A node that ran an earlier build of the image keeps its lower layers (the OS, the 2.5 GB of
dependencies) when only llmctl's layer changed, or the same layers under another name. `docker
load` looks each layer of the manifest up by its chain id before it opens the layer's file, so a
file with the same manifest and config and only the missing layers loads to the same image: a few
MB over SSH instead of gigabytes. Both layouts `docker save` writes are read: the legacy one
(`ID/layer.tar`, `ID.json`) and the OCI one (Docker 25 and later: `blobs/sha256/DIGEST`).
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from llmctl.cluster.errors import ImageMissingError


@dataclass(frozen=True)
class ImageFile:
    path: str
    image_id: str  # sha256:..., the config's digest
    layers: tuple[str, ...]  # diff ids, lowest first
    layer_paths: tuple[str, ...]  # the manifest's file of each layer
    repo_tags: tuple[str, ...]


def read_image_file(path: str, image: str) -> ImageFile:
    """The entry of `path`'s manifest for `image` (or its only entry). A file that is not a
    `docker save` tar, or holds several images none of which is `image`, is an error naming it."""
    try:
        with tarfile.open(path) as tar:
            entries = json.load(_member(tar, "manifest.json"))
            named = [e for e in entries if image in (e.get("RepoTags") or [])]
            if not named and len(entries) == 1:
                named = entries
            if not named:
                tags = ", ".join(sorted(t for e in entries for t in e.get("RepoTags") or []))
                raise ImageMissingError(
                    f"{path} holds no image {image} (it holds {tags or 'untagged ones'})",
                    f"make the file with docker save {image} -o FILE",
                )
            entry = named[0]
            config = json.load(_member(tar, entry["Config"]))
    except (OSError, tarfile.TarError, KeyError, ValueError) as e:
        raise ImageMissingError(
            f"{path} is not a `docker save` file ({e})",
            f"make it with docker save {image} -o FILE",
        ) from None
    layers = tuple(config["rootfs"]["diff_ids"])
    if len(layers) != len(entry["Layers"]):
        raise ImageMissingError(
            f"{path}: its manifest names {len(entry['Layers'])} layers, its config {len(layers)}",
            f"make the file again with docker save {image} -o FILE",
        )
    digest = entry["Config"].rsplit("/", 1)[-1].removesuffix(".json")
    return ImageFile(
        path=path,
        image_id=f"sha256:{digest}",
        layers=layers,
        layer_paths=tuple(entry["Layers"]),
        repo_tags=tuple(entry.get("RepoTags") or ()),
    )


def _member(tar: tarfile.TarFile, name: str):
    found = tar.extractfile(name)
    if found is None:
        raise KeyError(name)
    return found


def layers_held(wanted: tuple[str, ...], images: list[list[str]]) -> int:
    """How many of `wanted`'s lowest layers a daemon holds, given its images' layer lists: the
    longest prefix one of them shares (a stored layer is its whole chain, itself and below)."""
    held = 0
    for theirs in images:
        same = 0
        while same < min(len(theirs), len(wanted)) and theirs[same] == wanted[same]:
            same += 1
        held = max(held, same)
    return held


def write_thin(image: ImageFile, skip: int, dest: Path) -> Path:
    """A copy of the file at `dest` without the files of its `skip` lowest layers; the manifest,
    the config and the other layers as they are."""

    # legacy: a layer's directory (ID/layer.tar, ID/json, ID/VERSION); OCI: its blob, which a
    # layer higher up with the same content (an empty one, say) shares
    def files(paths: tuple[str, ...]) -> set[str]:
        return {p if p.startswith("blobs/") else p.split("/", 1)[0] for p in paths}

    dropped = files(image.layer_paths[:skip]) - files(image.layer_paths[skip:])
    with (
        tarfile.open(image.path) as full,
        tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as out,
    ):
        for member in full.getmembers():
            name = member.name.removeprefix("./")
            if name in dropped or name.split("/", 1)[0] in dropped:
                continue
            out.addfile(member, full.extractfile(member) if member.isfile() else None)
    return dest
