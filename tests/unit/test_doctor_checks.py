"""`llmctl doctor`'s checklist as pure functions: every check's pass and fail, each failure naming
the node and the fix; NCCL's log read from real log lines; what a node reports about itself."""

from __future__ import annotations

import json

import pytest

from llmctl.cluster.doctor.collective_report import (
    CollectiveReport,
    LinkResult,
    SizeResult,
    describe_stages,
    failure_report,
)
from llmctl.cluster.doctor.doctor_checks import (
    IfnameSpec,
    check_collective,
    check_env_consistency,
    check_host_ip,
    check_ifname,
    check_model,
    check_nvlink,
    check_shm,
    check_versions,
    failed,
    run_checks,
)
from llmctl.cluster.doctor.nccl_log import (
    assess_transport,
    normalize_transport,
    parse_nccl_channels,
    parse_nccl_transport,
)
from llmctl.cluster.doctor.node_facts import (
    NodeReport,
    distinct_names,
    parse_if_inet6,
    parse_nvidia_topo,
    relevant_env,
)
from llmctl.cluster.launch.parsers import (
    parse_ip_addr,
)

GIB = 1 << 30
VERSIONS = {"python": "3.11.7", "torch": "2.13.0+cpu", "ray": "2.60.0", "llmctl": "0.1.0"}
ONE_NIC = """\
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
2: eth0    inet {ip}/24 brd 10.0.0.255 scope global eth0\\       valid_lft forever
2: eth0    inet6 fd00::{last}/64 scope global \\       valid_lft forever preferred_lft forever
2: eth0    inet6 fe80::1/64 scope link \\       valid_lft forever preferred_lft forever
"""
TWO_NICS = ONE_NIC + (
    "3: ib0    inet 192.168.5.{last}/24 scope global ib0\\       valid_lft forever\n"
    "4: docker0    inet 172.17.0.1/16 brd 172.17.255.255 scope global docker0\\       valid\n"
)


def node(name="n1", ip="10.0.0.1", *, nics=ONE_NIC, host_ip="same", **kw) -> NodeReport:
    last = ip.rsplit(".", 1)[1]
    fields = dict(
        node=name,
        host_ip=ip if host_ip == "same" else host_ip,
        addresses=tuple(parse_ip_addr(nics.format(ip=ip, last=last))),
        shm_bytes=16 * GIB,
        versions=dict(VERSIONS),
    )
    fields.update(kw)
    return NodeReport(**fields)


def cluster(*nodes: NodeReport) -> list[NodeReport]:
    return list(nodes)


# -- host_ip ---------------------------------------------------------------------------------


def test_host_ip_owned_and_equal_to_rays_passes():
    result = check_host_ip(node(ray_ip="10.0.0.1"), 2)
    assert (result.status, result.node) == ("pass", "n1")
    assert "10.0.0.1 on eth0" in result.detail


def test_host_ip_not_owned_fails_naming_the_node_and_its_addresses():
    result = check_host_ip(node("n2", "10.0.0.2", host_ip="10.0.0.9"), 2)
    assert (result.status, result.node) == ("fail", "n2")
    assert "VLLM_HOST_IP=10.0.0.9 is not an address of n2" in result.detail
    assert "10.0.0.2 (eth0)" in result.detail
    assert "set VLLM_HOST_IP on n2" in result.fix


def test_host_ip_differing_from_rays_node_ip_fails():
    result = check_host_ip(node("n2", "10.0.0.2", nics=TWO_NICS, ray_ip="192.168.5.2"), 2)
    assert result.status == "fail"
    assert "VLLM_HOST_IP=10.0.0.2 on n2 but Ray knows the node as 192.168.5.2" in result.detail
    assert "--node-ip-address=10.0.0.2" in result.fix


def test_several_addresses_without_host_ip_fail_in_a_cluster_naming_them():
    report = node("n3", "10.0.0.3", nics=TWO_NICS, host_ip=None)
    result = check_host_ip(report, cluster_size=2)
    assert (result.status, result.node) == ("fail", "n3")
    for address in ("10.0.0.3 (eth0)", "192.168.5.3 (ib0)", "172.17.0.1 (docker0)"):
        assert address in result.detail
    assert result.fix.startswith("set VLLM_HOST_IP on n3")
    assert check_host_ip(report, cluster_size=1).status == "warn"  # one node: any address works


def test_one_nic_with_ipv4_and_ipv6_is_a_single_choice():
    result = check_host_ip(node(host_ip=None), 2)
    assert result.status == "pass"
    assert "the only address is 10.0.0.1" in result.detail


def test_loopback_host_ip_fails_in_a_cluster_only():
    report = node(host_ip="127.0.0.1")
    assert check_host_ip(report, 1).status == "pass"
    result = check_host_ip(report, 3)
    assert result.status == "fail" and "loopback" in result.detail


# -- ifname ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "chosen"),
    [
        ("eth", ["eth0", "eth1"]),  # prefixes
        ("=eth", []),  # exact names
        ("=eth0,ib0", ["eth0", "ib0"]),
        ("^docker,lo", ["eth0", "eth1", "ib0"]),  # exclusion by prefix
        ("^=eth0", ["lo", "eth1", "ib0", "docker0"]),  # exclusion of exact names
    ],
)
def test_nccl_ifname_syntax(value, chosen):
    assert IfnameSpec.parse(value).select(["lo", "eth0", "eth1", "ib0", "docker0"]) == chosen


def test_ifname_selecting_the_host_ip_interface_passes():
    env = {"NCCL_SOCKET_IFNAME": "^docker,lo", "GLOO_SOCKET_IFNAME": "eth0"}
    result = check_ifname(node(env=env))
    assert result.status == "pass"
    assert "GLOO_SOCKET_IFNAME=eth0 -> eth0" in result.detail


def test_gloo_ifname_naming_a_missing_interface_fails():
    result = check_ifname(node("n2", "10.0.0.2", env={"GLOO_SOCKET_IFNAME": "ens5"}))
    assert (result.status, result.node) == ("fail", "n2")
    assert "GLOO_SOCKET_IFNAME=ens5 names ens5, missing on n2 (it has lo, eth0)" in result.detail
    assert result.fix == "set GLOO_SOCKET_IFNAME on n2 to eth0"


def test_nccl_ifname_matching_nothing_fails():
    result = check_ifname(node(env={"NCCL_SOCKET_IFNAME": "=eth"}))
    assert result.status == "fail"
    assert "NCCL_SOCKET_IFNAME==eth matches no interface on n1" in result.detail


def test_ifname_avoiding_the_host_ip_interface_warns():
    report = node(nics=TWO_NICS, env={"NCCL_SOCKET_IFNAME": "ib"})
    result = check_ifname(report)
    assert result.status == "warn"
    assert "NCCL_SOCKET_IFNAME=ib selects ib0; VLLM_HOST_IP is on eth0" in result.detail
    assert result.fix == "set NCCL_SOCKET_IFNAME on n1 to eth0"


def test_unset_ifname_with_several_interfaces_warns():
    result = check_ifname(node(nics=TWO_NICS))
    assert result.status == "warn" and "docker0, eth0, ib0" in result.detail
    assert check_ifname(node()).status == "pass"


# -- environment -----------------------------------------------------------------------------


def test_env_that_must_agree_fails_on_the_node_that_differs():
    head = node(env={"NCCL_IB_DISABLE": "0", "VLLM_USE_V1": "1", "RAY_AUTH_MODE": "token"})
    worker = node("n2", "10.0.0.2", env={"NCCL_IB_DISABLE": "1", "VLLM_USE_V1": "1"})
    results = check_env_consistency(cluster(head, worker))
    assert [r.status for r in results] == ["pass", "fail"]
    bad = results[1]
    assert bad.node == "n2"
    assert "NCCL_IB_DISABLE=1 here, =0 on n1" in bad.detail
    assert "RAY_AUTH_MODEunset here, =token on n1" in bad.detail
    assert "NCCL_IB_DISABLE, RAY_AUTH_MODE" in bad.fix


def test_per_node_variables_may_differ():
    head = node(env={"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0", "RAY_RAYLET_PID": "1"})
    worker = node(
        "n2",
        "10.0.0.2",
        env={"NCCL_SOCKET_IFNAME": "ens5", "NCCL_IB_HCA": "mlx5_1", "RAY_RAYLET_PID": "7"},
    )
    assert [r.status for r in check_env_consistency(cluster(head, worker))] == ["pass", "pass"]


def test_secrets_are_masked_but_their_absence_is_seen():
    env = relevant_env(
        {"RAY_AUTH_TOKEN": "s3cr3t", "NCCL_IB_HCA": "mlx5", "VLLM_API_KEY": "k", "HOME": "/r"}
    )
    assert env == {"NCCL_IB_HCA": "mlx5", "RAY_AUTH_TOKEN": "***", "VLLM_API_KEY": "***"}
    head, worker = node(env=env), node("n2", "10.0.0.2", env={"NCCL_IB_HCA": "mlx5"})
    bad = check_env_consistency(cluster(head, worker))[1]
    assert bad.status == "fail" and "RAY_AUTH_TOKENunset here, =*** on n1" in bad.detail
    assert "s3cr3t" not in json.dumps(head.to_json())


# -- /dev/shm, versions, model, NVLink ------------------------------------------------------------


def test_small_shm_fails_with_the_docker_fix():
    result = check_shm(node("n2", "10.0.0.2", shm_bytes=64 << 20))
    assert (result.status, result.node) == ("fail", "n2")
    assert result.detail == "/dev/shm on n2 is 64 MiB, below 1.00 GiB"
    assert "--shm-size 10.24g or --ipc=host" in result.fix
    assert check_shm(node(shm_bytes=2 * GIB)).status == "warn"
    assert check_shm(node(shm_bytes=None)).status == "fail"
    assert check_shm(node()).status == "pass"


def test_versions_differing_from_the_head_fail():
    worker = node("n2", "10.0.0.2", versions={**VERSIONS, "torch": "2.4.0", "ray": None})
    results = check_versions(cluster(node(), worker))
    assert [r.status for r in results] == ["pass", "fail"]
    assert "torch 2.4.0 here, 2.13.0+cpu on n1" in results[1].detail
    assert "ray missing here, 2.60.0 on n1" in results[1].detail
    assert "same container image" in results[1].fix
    patch = node("n3", "10.0.0.3", versions={**VERSIONS, "python": "3.11.9"})
    assert check_versions(cluster(node(), patch))[1].status == "warn"
    assert check_versions(cluster(node(), node("n2", "10.0.0.2")))[1].status == "pass"


def test_model_fingerprint_must_equal_the_heads():
    head = node(model="/models/m", model_fingerprint="aaaa")
    same = node("n2", "10.0.0.2", model="/models/m", model_fingerprint="aaaa")
    other = node("n3", "10.0.0.3", model="/models/m", model_fingerprint="bbbb")
    missing = node("n4", "10.0.0.4", model="/models/m", model_fingerprint=None)
    results = check_model(cluster(head, same, other, missing))
    assert [(r.node, r.status) for r in results] == [
        ("n1", "pass"),
        ("n2", "pass"),
        ("n3", "fail"),
        ("n4", "fail"),
    ]
    assert "differs from n1's (fingerprint bbbb vs aaaa)" in results[2].detail
    assert results[3].detail == "the model /models/m is missing on n4"
    assert "--sync-model" in results[3].fix
    assert check_model(cluster(node(), node("n2", "10.0.0.2"))) == []  # no model: no rows


def test_nvlink_expected_but_absent_fails():
    assert check_nvlink(node(gpus=8, nvlink=True), True).status == "pass"
    pcie = check_nvlink(node("n2", "10.0.0.2", gpus=8, nvlink=False), True)
    assert (pcie.status, pcie.node) == ("fail", "n2")
    assert "--interconnect pcie" in pcie.fix
    assert check_nvlink(node(gpus=1), True).status == "fail"
    assert check_nvlink(node(gpus=None), True).status == "warn"
    assert check_nvlink(node(gpus=8, nvlink=False), False).status == "pass"


def test_run_checks_gives_one_row_per_check_and_node():
    reports = cluster(node(), node("n2", "10.0.0.2", shm_bytes=64 << 20))
    results = run_checks(reports, expect_nvlink=None)
    checks = ["host_ip", "ifname", "env", "shm", "versions"]
    assert [(r.check, r.node) for r in results] == [(c, n) for c in checks for n in ("n1", "n2")]
    assert failed(results) and [r.node for r in results if r.status == "fail"] == ["n2"]
    assert not failed(run_checks(reports[:1]))
    assert len(run_checks(reports, expect_nvlink=True)) == len(results) + 2


# -- what a node reports ---------------------------------------------------------------------


def test_report_round_trips_through_json():
    report = node(env={"NCCL_IB_HCA": "mlx5"}, ray_ip="10.0.0.1", gpus=2, nvlink=True)
    again = NodeReport.from_json(json.loads(json.dumps(report.to_json())))
    assert again == report


def test_parse_if_inet6():
    text = (
        "fe8000000000000000fc00fffe000001 04 40 20 80     eth0\n"
        "fd000000000000000000000000000002 04 40 00 82     eth0\n"
        "00000000000000000000000000000001 01 80 10 80       lo\n"
    )
    assert [(a.ifname, str(a.interface)) for a in parse_if_inet6(text)] == [
        ("eth0", "fe80::fc:ff:fe00:1/64"),
        ("eth0", "fd00::2/64"),
        ("lo", "::1/128"),
    ]


def test_nvidia_topo():
    nvlink = (
        "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV1\tNV2\tNV1\t0-71\t0-1\n"
        "GPU1\tNV1\t X \tNV1\tNV2\t0-71\t0-1\n"
        "GPU2\tNV2\tNV1\t X \tNV2\t0-71\t0-1\n"
        "GPU3\tNV1\tNV2\tNV2\t X \t0-71\t0-1\n"
    )
    pcie = (
        "\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tPHB\tSYS\t0-23\t0\n"
        "GPU1\tPHB\t X \tSYS\t0-23\t0\n"
        "NIC0\tSYS\tSYS\t X \t\t\n"
    )
    assert parse_nvidia_topo(nvlink) is True
    assert parse_nvidia_topo(pcie) is False
    assert parse_nvidia_topo("\tGPU0\tCPU Affinity\nGPU0\t X \t0-7\n") is None


def test_repeated_hostnames_get_their_ip():
    names = [r.node for r in distinct_names([node("vm"), node("vm", "10.0.0.2"), node("b")])]
    assert names == ["vm@10.0.0.1", "vm@10.0.0.2", "b"]
    same_ip = distinct_names([node("vm"), node("vm")])  # two Ray nodes on one machine
    assert [r.node for r in same_ip] == ["vm@10.0.0.1#0", "vm@10.0.0.1#1"]


# -- NCCL's log ------------------------------------------------------------------------------

IB_LOG = """\
gpu152:1208:0 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:10.9.4.1<0>
gpu152:1208:0 [0] NCCL INFO Using network IB
gpu152:1208:1 [1] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read
gpu152:1208:0 [0] NCCL INFO Channel 01/0 : 2[c7000] -> 0[87000] [receive] via NET/IB/5/GDRDMA
gpu152:1208:0 [0] NCCL INFO Channel 01/0 : 0[87000] -> 2[c7000] [send] via NET/IB/5/GDRDMA
gpu152:1208:3 [3] NCCL INFO Channel 02/0 : 3[ca000] -> 0[87000] [send] via NET/IB/0/GDRDMA
"""
SOCKET_LOG = """\
node-a:2017:2060 [0] NCCL INFO NET/Socket : Using [0]bond0:200.8.184.2<0>
node-a:2017:2060 [0] NCCL INFO Using network Socket
node-a:2017:2060 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM
node-a:2017:2060 [0] NCCL INFO Channel 00/0 : 2[0] -> 0[0] [receive] via NET/Socket/0
node-a:2017:2060 [0] NCCL INFO Channel 00/0 : 0[0] -> 2[0] [send] via NET/Socket/0
"""


def test_nccl_transport_from_real_log_lines():
    assert parse_nccl_transport(IB_LOG) == "NET/IB/GDRDMA"
    assert parse_nccl_transport(SOCKET_LOG) == "NET/Socket"  # the weakest channel decides
    p2p = "h:1:2 [1] NCCL INFO Channel 01/0 : 1[1] -> 0[0] via P2P/CUMEM/read\n"
    assert parse_nccl_transport(p2p) == "P2P/CUMEM"
    shm = (
        "h:1:2 [3] NCCL INFO Channel 00 : 3[3] -> 4[4] via SHM/direct/direct\n"
        "h:1:2 [2] NCCL INFO Channel 00/1 : 2[2] -> 3[3] via P2P/direct pointer\n"
    )
    assert parse_nccl_transport(shm) == "SHM"
    plugin = "h:987:1260 [7] NCCL INFO Channel 03/0 : 47[7] -> 39[7] [receive] via NET/IBext_v8/2\n"
    assert parse_nccl_transport(plugin) == "NET/IB"
    assert parse_nccl_transport("h:1:1 [0] NCCL INFO Using network Socket\n") == "NET/Socket"
    assert parse_nccl_transport("h:1:1 [0] NCCL INFO cudaDriverVersion 12020\n") is None


def test_nccl_channels_name_both_ranks():
    channels = parse_nccl_channels(SOCKET_LOG)
    assert [(c.src, c.dst, c.transport) for c in channels] == [
        (0, 1, "P2P/CUMEM"),
        (2, 0, "NET/Socket"),
        (0, 2, "NET/Socket"),
    ]


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("NET/IB/1(3)/GDRDMA(PCI)/Shared", "NET/IB/GDRDMA"),
        ("NET/Socket/1", "NET/Socket"),
        ("P2P/IPC", "P2P/IPC"),
        ("P2P/direct pointer/read", "P2P/direct"),
    ],
)
def test_normalize_transport(raw, normal):
    assert normalize_transport(raw) == normal


def test_socket_between_nodes_warns_with_the_infiniband_fix():
    status, detail, fix = assess_transport("NET/Socket", cross_node=True)
    assert status == "warn" and "NET/Socket between nodes" in detail
    for knob in ("--privileged", "/dev/infiniband", "NCCL_IB_HCA"):
        assert knob in fix
    assert assess_transport("NET/Socket", cross_node=False)[0] == "pass"
    assert assess_transport("NET/IB/GDRDMA", cross_node=True) == ("pass", "NET/IB/GDRDMA", None)


# -- the all-reduce check as rows ------------------------------------------------------------


def test_collective_rows_name_the_link_and_its_transport():
    report = CollectiveReport(
        backend="nccl",
        world_size=2,
        nodes=("n1", "n2"),
        sizes=(SizeResult(4, 50, 30.0, 0.0, 0.0), SizeResult(1 << 24, 5, 900.0, 18.6, 18.6)),
        links=(LinkResult(0, 1, 12.5, 11.0, "n1", "n2", "NET/Socket"),),
        transport="NET/Socket",
    )
    head, link = check_collective(report)
    assert (head.check, head.node, head.status) == ("allreduce/nccl", "n1", "pass")
    assert "sums correct" in head.detail and "16 MiB: 900 us, busbw 18.60 GB/s" in head.detail
    assert (link.check, link.node, link.status) == ("link/nccl", "n2", "warn")
    assert "rank 0 (n1) -> rank 1: 12 us, 11.00 GB/s" in link.detail
    assert "NCCL_IB_HCA" in link.fix


def test_collective_timeout_fails_on_the_node_that_was_behind():
    stages = ["all-reduce", "all-reduce", "rendezvous"]
    text, behind = describe_stages(stages, ["n1", "n2", "n3"])
    assert behind == [2]
    assert text == "rank 2 (on n3) stuck in rendezvous; ranks 0, 1 (on n1, n2) waited in all-reduce"
    report = failure_report("gloo", ["n1", "n2", "n3"], stages, "10.0.0.1", timeout_s=30)
    (row,) = check_collective(report)
    assert (row.node, row.status) == ("n3", "fail")
    assert "timed out after 30 s" in row.detail and "10.0.0.1" in row.fix
    assert failed([row])


def test_wrong_sums_fail():
    report = CollectiveReport(
        "gloo", 2, ("n1", "n2"), sizes=(SizeResult(1 << 20, 10, 5.0, 1.0, 1.0, correct=False),)
    )
    (row,) = check_collective(report)
    assert row.status == "fail" and "wrong sums at 1 MiB" in row.detail
