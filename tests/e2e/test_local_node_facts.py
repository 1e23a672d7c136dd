"""What this machine reports about itself, read with the real commands (`ip`, `find`,
`sha256sum`, /dev/shm): the same probe `cluster up` runs over SSH, through the local transport."""

from __future__ import annotations

import os
import platform
import socket
import subprocess

from llmctl.cluster.doctor.node_facts import (
    collect_local_report,
    local_addresses,
    local_model_fingerprint,
)
from llmctl.cluster.launch import commands
from llmctl.cluster.launch.parsers import (
    hashed_files,
    model_fingerprint,
    parse_listing,
    parse_sha256sum,
)


def test_local_report_describes_this_machine():
    report = collect_local_report()
    assert report.node == socket.gethostname()
    assert report.host_ip == (os.environ.get("VLLM_HOST_IP") or None)
    assert any(a.ifname == "lo" and a.ip == "127.0.0.1" for a in report.addresses)
    stat = os.statvfs("/dev/shm")
    assert report.shm_bytes == stat.f_frsize * stat.f_blocks
    assert report.versions["python"] == platform.python_version()
    assert report.versions["llmctl"] and report.versions["torch"]
    assert all(k.startswith(("NCCL_", "GLOO_", "VLLM_", "RAY_", "TORCH_NCCL_")) for k in report.env)


def test_addresses_without_the_ip_command(monkeypatch):
    expected = {(a.ifname, a.ip) for a in local_addresses()}
    monkeypatch.setenv("PATH", "/nonexistent")  # `ip` not found: the kernel's tables instead
    found = {(a.ifname, a.ip) for a in local_addresses()}
    assert ("lo", "127.0.0.1") in found
    ipv4 = {(n, ip) for n, ip in expected if ":" not in ip}
    assert ipv4 <= found  # each interface's (primary) IPv4 address


def test_model_fingerprint_equals_the_one_cluster_up_computes_over_ssh(tmp_path):
    # Laid out as a Hugging Face cache snapshot: a folder of symlinks into blobs/.
    blobs, model = tmp_path / "blobs", tmp_path / "model"
    blobs.mkdir()
    model.mkdir()
    (blobs / "a").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (blobs / "b").write_bytes(b"\0" * 1000)
    (blobs / "c").write_text("{}")
    for name, blob in [("config.json", "a"), ("model.safetensors", "b"), ("tokenizer.json", "c")]:
        (model / name).symlink_to(blobs / blob)
    # What probe.fingerprint runs on a node: find, then sha256sum of the hashed files.
    find = commands.model_listing_argv(str(model))
    files = parse_listing(subprocess.run(find, capture_output=True, text=True).stdout)
    assert files == {"config.json": 39, "model.safetensors": 1000, "tokenizer.json": 2}
    paths = [str(model / n) for n in hashed_files(files)]
    digests = parse_sha256sum(
        subprocess.run(["sha256sum", "--", *paths], capture_output=True, text=True).stdout
    )
    assert local_model_fingerprint(str(model)) == model_fingerprint(files, digests)
    (blobs / "a").write_text('{"architectures": ["MistralForCausalLM"]}')
    assert local_model_fingerprint(str(model)) != model_fingerprint(files, digests)
    assert local_model_fingerprint(str(tmp_path / "absent")) is None
    report = collect_local_report(str(model))
    assert report.model == str(model) and report.model_fingerprint
