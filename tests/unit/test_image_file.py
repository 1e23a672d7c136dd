"""`cluster up --image-file`: the `docker save` file read in both layouts, and a node given only
the layers it lacks (cluster/launch/image_file.py, transfer.load_image_file). The test bed loads
such thin files into real daemons (tests/e2e/cluster/test_launcher.py)."""

from __future__ import annotations

import io
import json
import tarfile
from hashlib import sha256
from pathlib import Path

import pytest
from fake_transport import FakeTransport

from llmctl.cluster.errors import ImageMissingError
from llmctl.cluster.launch.image_file import layers_held, read_image_file, write_thin
from llmctl.cluster.launch.transfer import load_image_file


def layer_tar(content: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo("f")
        info.size = len(content)
        t.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def add(t: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    t.addfile(info, io.BytesIO(data))


def saved_file(path: Path, contents: list[bytes], *, oci: bool, tags=("img:1",)) -> list[str]:
    """A `docker save` file of one image whose layers hold `contents`; returns the diff ids."""
    layers = [layer_tar(c) for c in contents]
    diff_ids = [f"sha256:{sha256(b).hexdigest()}" for b in layers]
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    config_digest = sha256(config).hexdigest()
    with tarfile.open(path, "w") as t:
        if oci:
            paths = [f"blobs/sha256/{d.removeprefix('sha256:')}" for d in diff_ids]
            for p, b in dict(zip(paths, layers, strict=True)).items():  # a shared blob once
                add(t, p, b)
            config_path = f"blobs/sha256/{config_digest}"
            add(t, "index.json", b"{}")
        else:
            paths = [f"v1id{i}/layer.tar" for i in range(len(layers))]
            for i, b in enumerate(layers):
                add(t, f"v1id{i}/VERSION", b"1.0")
                add(t, f"v1id{i}/json", b"{}")
                add(t, f"v1id{i}/layer.tar", b)
            config_path = f"{config_digest}.json"
        add(t, config_path, config)
        manifest = [{"Config": config_path, "RepoTags": list(tags), "Layers": paths}]
        add(t, "manifest.json", json.dumps(manifest).encode())
    return diff_ids


def names(path: Path) -> set[str]:
    with tarfile.open(path) as t:
        return set(t.getnames())


@pytest.mark.parametrize("oci", [False, True], ids=["legacy", "oci"])
def test_the_file_names_its_image_and_layers(tmp_path, oci):
    path = tmp_path / "img.tar"
    diff_ids = saved_file(path, [b"os", b"deps", b"llmctl"], oci=oci)
    image = read_image_file(str(path), "img:1")
    assert image.layers == tuple(diff_ids)
    assert image.repo_tags == ("img:1",)
    with tarfile.open(path) as t:
        (entry,) = json.load(t.extractfile("manifest.json"))
        config = t.extractfile(entry["Config"]).read()
    assert image.image_id == f"sha256:{sha256(config).hexdigest()}"  # what `docker images` shows


def test_a_file_that_is_not_docker_save_or_lacks_the_image_is_named(tmp_path):
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar")
    with pytest.raises(ImageMissingError, match="junk.tar is not a `docker save` file") as e:
        read_image_file(str(junk), "img:1")
    assert "docker save img:1 -o FILE" in e.value.hint
    two = tmp_path / "two.tar"
    saved_file(two, [b"a"], oci=False, tags=("a:1",))
    with tarfile.open(two) as t:  # a second entry: the file now holds a:1 and b:1
        manifest = json.load(t.extractfile("manifest.json"))
    manifest.append({**manifest[0], "RepoTags": ["b:1"]})
    with tarfile.open(two, "a") as t:
        add(t, "manifest.json", json.dumps(manifest).encode())
    assert read_image_file(str(two), "b:1").repo_tags == ("b:1",)
    with pytest.raises(ImageMissingError, match=r"holds no image img:1 \(it holds a:1, b:1\)"):
        read_image_file(str(two), "img:1")


def test_a_daemon_holds_the_longest_shared_prefix():
    wanted = ("l0", "l1", "l2", "l3")
    assert layers_held(wanted, []) == 0
    assert layers_held(wanted, [["l0", "l1", "x"], ["l0"], ["l1", "l2"]]) == 2
    assert layers_held(wanted, [["l0", "l1", "l2", "l3", "more"]]) == 4
    assert layers_held(wanted, [["x", "l1", "l2", "l3"]]) == 0  # l1 on another base is not ours


@pytest.mark.parametrize("oci", [False, True], ids=["legacy", "oci"])
def test_a_thin_file_drops_only_the_held_layers(tmp_path, oci):
    path = tmp_path / "img.tar"
    # The first and the last layer have the same content (empty layers do): in the OCI layout
    # they share one blob, which the last layer still needs.
    saved_file(path, [b"same", b"deps", b"same", b"llmctl"], oci=oci)
    image = read_image_file(str(path), "img:1")
    thin = write_thin(image, 2, tmp_path / "thin.tar")
    kept, full = names(thin), names(path)
    if oci:
        assert full - kept == {image.layer_paths[1]}
    else:
        assert full - kept == {"v1id0/VERSION", "v1id0/json", "v1id0/layer.tar",
                               "v1id1/VERSION", "v1id1/json", "v1id1/layer.tar"}  # fmt: skip
    assert "manifest.json" in kept
    with tarfile.open(thin) as t:
        assert json.load(t.extractfile("manifest.json"))[0]["Layers"] == list(image.layer_paths)


class Node(FakeTransport):
    """A node that takes uploads and records what `docker load` read."""

    def __init__(self, name: str, images: list[list[str]], refuse_thin: bool = False) -> None:
        super().__init__(name)
        self.loaded: list[set[str]] = []
        ids = [f"sha256:{i:064x}" for i in range(len(images))]
        self.reply(r"^docker image ls --quiet --no-trunc$", "".join(f"{i}\n" for i in ids))
        self.reply(r"^docker image inspect --format", "".join(json.dumps(x) + "\n" for x in images))
        self.reply(r"^mv -f -- ", self._mv)
        self.reply(r"^rm -f -- ", lambda argv: self.files.pop(argv[-1], None) and "")
        self.reply(r"^docker load --input ", self._load)
        self.refuse_thin = refuse_thin

    def open(self, path: str, mode: str = "rb"):
        if "w" not in mode:
            return super().open(path, mode)
        node = self

        class Upload(io.BytesIO):
            def close(self) -> None:
                node.files[path] = self.getvalue()
                super().close()

        return Upload()

    def _mv(self, argv: list[str]) -> str:
        self.files[argv[-1]] = self.files.pop(argv[-2])
        return ""

    def _load(self, argv: list[str]):
        with tarfile.open(fileobj=io.BytesIO(self.files[argv[-1]])) as t:
            got = set(t.getnames())
        self.loaded.append(got)
        if self.refuse_thin and len(self.loaded) == 1:
            return (1, "", "open /var/lib/docker/tmp/x/v1id0/layer.tar: no such file or directory")
        return "Loaded image: img:1\n"


def test_a_node_is_sent_only_the_layers_it_lacks(tmp_path):
    path = tmp_path / "img.tar"
    diff_ids = saved_file(path, [b"os", b"deps" * 1000, b"llmctl"], oci=False)
    image = read_image_file(str(path), "img:1")
    node = Node("n2", [diff_ids[:2] + ["an-older-llmctl"], ["unrelated"]])
    assert load_image_file(node, image).startswith("1 of 3 layers")
    (loaded,) = node.loaded
    assert "v1id2/layer.tar" in loaded and not {"v1id0/layer.tar", "v1id1/layer.tar"} & loaded
    assert not node.files  # the upload is removed
    bare = Node("n3", [])
    assert load_image_file(bare, image).startswith("all 3 layers")
    assert bare.loaded == [names(path)]


def test_a_daemon_that_refuses_the_thin_file_gets_the_whole_one(tmp_path):
    path = tmp_path / "img.tar"
    diff_ids = saved_file(path, [b"os", b"deps", b"llmctl"], oci=False)
    node = Node("n2", [diff_ids], refuse_thin=True)
    assert load_image_file(node, read_image_file(str(path), "img:1")).startswith("all 3 layers")
    assert [len(x) for x in node.loaded] == [2, len(names(path))]  # manifest + config, then all
