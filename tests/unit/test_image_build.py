"""`llmctl image build` without Docker: targets, the offline CPU build's argv, the two-layer
wheel split, the source hash that decides whether a build is up to date. The build itself runs
for real in tests/e2e/cluster (the llmctl_image fixture)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llmctl.cluster.errors import ConfigError, ImageBuildError
from llmctl.cluster.launch import image
from llmctl.cluster.launch.image import (
    DEBOOTSTRAP_BASE,
    RAY_LABEL,
    SOURCE_LABEL,
    ImageBuild,
    docker_build_argv,
    source_hash,
    source_root,
    split_wheels,
    up_to_date,
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
    assert f"BASE_IMAGE={DEBOOTSTRAP_BASE}" in argv
    assert "PIP_INSTALL_ARGS=--no-index" in argv
    assert "llmctl.source-hash=abc" in argv
    assert "PIP_INSTALL_ARGS=" in docker_build_argv(ImageBuild("t", target="cuda"), tmp_path, "a")


def test_cpu_image_compiles_the_cpu_kernels_and_cuda_does_not(tmp_path):
    # The engine in a cpu container without them ran plain torch: ~10x slower decode.
    assert "CPU_KERNELS=1" in docker_build_argv(ImageBuild("t"), tmp_path, "a")
    assert "CPU_KERNELS=" in docker_build_argv(ImageBuild("t", target="cuda"), tmp_path, "a")
    # The offline base carries the compiler; the Dockerfile installs it on the slim one.
    assert "g++" in image.debootstrap_argv(tmp_path, "http://mirror")[2].split("=")[1].split(",")
    dockerfile = (source_root() / "templates" / "Dockerfile").read_text()
    assert "python -m llmctl.engine.kernels.cpu.cpu_kernels" in dockerfile  # all of them


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


def test_no_ray_image_leaves_ray_out_of_the_wheels_and_the_install(tmp_path):
    root = source_root()
    build = ImageBuild("t", debootstrap=True, ray=False)
    wheels = wheel_argv(build, root, tmp_path)
    assert str(root) in wheels and f"{root}[ray]" not in wheels  # no Ray wheel is even built
    argv = docker_build_argv(build, tmp_path, "abc")
    assert "LLMCTL_EXTRAS=" in argv and "llmctl.ray=no" in argv
    with_ray = docker_build_argv(ImageBuild("t"), tmp_path, "abc")
    assert "LLMCTL_EXTRAS=[ray]" in with_ray and "llmctl.ray=yes" in with_ray
    # The Dockerfile installs llmctl with exactly those extras.
    dockerfile = (root / "templates" / "Dockerfile").read_text()
    assert '"${wheel}${LLMCTL_EXTRAS}"' in dockerfile and 'ARG LLMCTL_EXTRAS="[ray]"' in dockerfile


def test_an_image_with_ray_is_not_up_to_date_for_no_ray(monkeypatch):
    labels = {SOURCE_LABEL: "abc", RAY_LABEL: "yes"}
    monkeypatch.setattr(image, "image_label", lambda tag, label: labels.get(label, "<no value>"))
    assert up_to_date(ImageBuild("t"), "abc")
    assert not up_to_date(ImageBuild("t", ray=False), "abc")
    assert not up_to_date(ImageBuild("t"), "other sources")
    del labels[RAY_LABEL]  # built before the label: it has Ray
    assert up_to_date(ImageBuild("t"), "abc") and not up_to_date(ImageBuild("t", ray=False), "abc")


def test_image_build_dry_run_prints_the_no_ray_commands():
    from typer.testing import CliRunner

    from llmctl.cli.main import app

    result = CliRunner().invoke(app, ["image", "build", "--no-ray", "--dry-run", "--tag", "t:1"])
    assert result.exit_code == 0, result.output
    assert "LLMCTL_EXTRAS= " in result.output and "llmctl.ray=no" in result.output
    assert "[ray]" not in result.output
