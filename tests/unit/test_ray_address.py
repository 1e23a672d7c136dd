"""Which Ray cluster llmctl joins (engine/distributed/ray_address.py): RAY_ADDRESS, else the one
`ray start` recorded in Ray's temp directory, else none; an address nobody answers at is a typed
error at once, not Ray's minutes of retries."""

from __future__ import annotations

import socket

import pytest

from llmctl.engine.distributed.ray_address import (
    RayAddress,
    check_reachable,
    find_ray_address,
    ray_temp_dir,
)
from llmctl.engine.errors import ConfigError


@pytest.fixture
def ray_tmp(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    return tmp_path / "ray"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_tmpdir_then_tmpdir_then_tmp(monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", "/a")
    monkeypatch.setenv("TMPDIR", "/b")
    assert ray_temp_dir() == "/a/ray"
    monkeypatch.delenv("RAY_TMPDIR")
    assert ray_temp_dir() == "/b/ray"
    monkeypatch.delenv("TMPDIR")
    assert ray_temp_dir() == "/tmp/ray"


def test_nothing_recorded_means_a_private_ray(ray_tmp):
    assert find_ray_address() is None
    (ray_tmp / "ray_current_cluster").write_text("\n")  # emptied: as good as absent
    assert find_ray_address() is None


def test_the_ray_start_record_then_ray_address(ray_tmp, monkeypatch):
    record = ray_tmp / "ray_current_cluster"
    record.write_text("10.0.0.1:6379\n")
    assert find_ray_address() == RayAddress("10.0.0.1:6379", str(record))
    monkeypatch.setenv("RAY_ADDRESS", " 10.0.0.2:6379 ")
    assert find_ray_address() == RayAddress("10.0.0.2:6379", "RAY_ADDRESS")
    monkeypatch.setenv("RAY_ADDRESS", "")  # set but empty: as Ray reads it, not set
    assert find_ray_address().source == str(record)


def test_a_stale_record_is_named_with_what_to_do(ray_tmp):
    record = ray_tmp / "ray_current_cluster"
    record.write_text(f"127.0.0.1:{closed_port()}")
    with pytest.raises(ConfigError) as caught:
        check_reachable(find_ray_address())
    assert "no Ray cluster answers at 127.0.0.1:" in caught.value.message
    assert f"the address `ray start` recorded in {record}" in caught.value.message
    assert "that cluster is gone" in caught.value.hint and "`ray stop`" in caught.value.hint


def test_ray_address_to_nowhere_is_named(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{closed_port()}")
    with pytest.raises(ConfigError, match="the address RAY_ADDRESS names") as caught:
        check_reachable(find_ray_address())
    assert "unset RAY_ADDRESS" in caught.value.hint


def test_a_listening_head_and_other_forms_pass():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(RayAddress(f"127.0.0.1:{server.getsockname()[1]}", "RAY_ADDRESS"))
    for form in ("ray://10.0.0.1:10001", "auto", "local"):  # Ray's to interpret
        check_reachable(RayAddress(form, "RAY_ADDRESS"))
