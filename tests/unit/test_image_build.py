"""`llmctl image build` without Docker: targets, the offline CPU build's argv, the two-layer
wheel split, the source hash that decides whether a build is up to date. The build itself runs
for real in tests/e2e/cluster (the llmctl_image fixture)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llmctl.cluster.errors import ConfigError, ImageBuildError
from llmctl.cluster.launch.image import (
    DEBOOTSTRAP_BASE,
    ImageBuild,
    docker_build_argv,
    source_hash,
    source_root,
    split_wheels,
    wheel_argv,
)


def test_targets_and_bases():
    assert ImageBuild("t").base == "python:3.11-slim-bookworm"
    assert ImageBuild("t", debootstrap=True).base == DEBOOTSTRAP_BASE
    assert ImageBuild("t", target="cuda").base.startswith("nvidia/cuda:")
    assert ImageBuild("t", base_image="my/python:3.12").base == "my/python:3.12"
    with pytest.raises(ConfigError, match="unknown image target 'rocm'") as err:
        ImageBuild("t", target="rocm")
    assert "cpu" in err.value.hint and "cuda" in err.value.hint
    with pytest.raises(ConfigError, match="--debootstrap builds a CPU base"):
        ImageBuild("t", target="cuda", debootstrap=True)


def test_cpu_build_is_offline_and_cuda_takes_dependencies_from_pypi(tmp_path):
    root = source_root()
    cpu = wheel_argv(ImageBuild("t"), root, tmp_path)
    assert f"{root}[ray]" in cpu and "torch==2.13.0" in cpu  # the CPU torch wheel, built here
    cuda = wheel_argv(ImageBuild("t", target="cuda"), root, tmp_path)
    assert "--no-deps" in cuda and "torch==2.13.0" not in cuda
    argv = docker_build_argv(ImageBuild("t", debootstrap=True), tmp_path, "abc")
    assert argv[:4] == ["docker", "build", "--network", "host"]
    assert "BASE_IMAGE=llmctl-base:bookworm" in argv
    assert "PIP_INSTALL_ARGS=--no-index" in argv
    assert "llmctl.source-hash=abc" in argv
    assert "PIP_INSTALL_ARGS=" in docker_build_argv(ImageBuild("t", target="cuda"), tmp_path, "a")


def test_llmctl_wheel_goes_to_its_own_layer(tmp_path):
    deps = tmp_path / "deps"
    deps.mkdir()
    for name in ("llmctl-0.1.0-py3-none-any.whl", "torch-2.13.0-cp311-linux_x86_64.whl"):
        (deps / name).write_bytes(b"wheel")
    split_wheels(tmp_path)
    assert [p.name for p in deps.iterdir()] == ["torch-2.13.0-cp311-linux_x86_64.whl"]
    assert [p.name for p in (tmp_path / "llmctl").iterdir()] == ["llmctl-0.1.0-py3-none-any.whl"]
    with pytest.raises(ImageBuildError, match="pip wheel made 0 llmctl wheels"):
        split_wheels(tmp_path)


def test_source_hash_follows_the_sources(tmp_path):
    root = tmp_path / "src"
    shutil.copytree(source_root(), root, ignore=shutil.ignore_patterns(".*", "tests", "*.egg*"))
    before = source_hash(root)
    assert source_hash(root) == before
    (root / "README.md").write_text("docs do not change the image")
    assert source_hash(root) == before
    engine_file = next((root / "engine").rglob("*.py"))
    engine_file.write_text(engine_file.read_text() + "\n# changed\n")
    assert source_hash(root) != before
    assert len(before) == 16 and Path(root / "templates" / "Dockerfile").is_file()
