"""The test bed is real: each host is its own machine as far as SSH, the network, /srv/llmctl and
Docker can tell. These guard the launcher's end-to-end tests against a broken bed."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from testbed import Host, Testbed


def ssh(bed: Testbed, host: Host, command: list[str]) -> subprocess.CompletedProcess[str]:
    """Plain OpenSSH as a user would run it (root, the bed's client key, no host key pinning)."""
    argv = ["ssh", "-i", str(bed.client_key), "-o", "StrictHostKeyChecking=no"]
    argv += ["-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]
    argv += [f"root@{host.ip}", shlex.join(command)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_ssh_lands_on_each_host_with_its_own_address_and_docker_host(testbed: Testbed) -> None:
    for host in testbed.hosts:
        script = "ip -o -4 addr show eth0; echo DOCKER_HOST=$DOCKER_HOST"
        out = ssh(testbed, host, ["sh", "-c", script])
        assert out.returncode == 0, out.stderr
        assert re.findall(r"inet (\S+)", out.stdout) == [f"{host.ip}/24"]
        assert f"DOCKER_HOST=unix:///run/docker-{host.name}.sock" in out.stdout


def test_host_keys_are_pinned_in_known_hosts(testbed: Testbed) -> None:
    # StrictHostKeyChecking=yes: fails unless each sshd presents the key the bed recorded.
    for host in testbed.hosts:
        out = subprocess.run(
            testbed.ssh_argv(host, ["hostname", "-I"]), capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [host.ip]


def test_hosts_reach_each_other_through_the_bridge(testbed: Testbed) -> None:
    n1, n2 = testbed.hosts[:2]
    # FORWARD's DROP policy (set by the root dockerd) would make this hang, not fail: time it out.
    script = 'exec 3<>"/dev/tcp/$1/22" && head -c 4 <&3'
    banner = n1.run(["bash", "-c", script, "bash", n2.ip], timeout=15)
    assert banner.stdout == "SSH-"
    # A whole SSH session from host 1 to host 2: host 2 sees host 1's address as the client.
    hop = n1.run(testbed.ssh_argv(n2, ["sh", "-c", "echo $SSH_CLIENT; hostname -I"]), timeout=30)
    client, *_ = hop.stdout.split()
    assert client == n1.ip
    assert hop.stdout.splitlines()[1].split() == [n2.ip]


def test_srv_llmctl_is_per_host(testbed: Testbed) -> None:
    for host in testbed.hosts:
        (host.srv_dir / "whoami").write_text(host.name)
        host.run(["sh", "-c", 'echo "$1" > /srv/llmctl/written-inside', "sh", host.ip])
    for host in testbed.hosts:
        out = ssh(testbed, host, ["cat", "/srv/llmctl/whoami"])
        assert out.stdout == host.name, out.stderr
        assert (host.srv_dir / "written-inside").read_text() == f"{host.ip}\n"
    assert not Path("/srv/llmctl/whoami").exists()  # the root namespace's /srv/llmctl is apart


def test_each_host_talks_to_its_own_docker_daemon_and_n4_has_none(testbed: Testbed) -> None:
    for host in testbed.docker_hosts:
        out = ssh(testbed, host, ["docker", "info", "--format", "{{.DockerRootDir}}"])
        assert out.stdout.strip() == str(host.docker_root), out.stderr
    n4 = testbed.hosts[3]
    assert not n4.has_docker
    out = ssh(testbed, n4, ["docker", "info"])
    assert out.returncode != 0
    assert f"Cannot connect to the Docker daemon at unix:///run/docker-{n4.name}.sock" in out.stderr
    assert not Path(n4.docker_sock).exists()


def test_host_network_container_sees_its_host_address(testbed: Testbed, llmctl_image) -> None:
    n2 = testbed.hosts[1]
    # The source address the container's kernel picks to reach the bridge: the host's own.
    probe = (
        "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
        "s.connect(('10.77.0.1', 9)); print(s.getsockname()[0])"
    )
    docker_run = ["docker", "run", "--rm", "--network", "host", llmctl_image]
    out = ssh(testbed, n2, [*docker_run, "sh", "-c", 'hostname -I; python3 -c "$1"', "sh", probe])
    assert out.returncode == 0, out.stderr
    addresses, source = out.stdout.splitlines()
    assert addresses.split() == [n2.ip]
    assert source == n2.ip


def test_docker_can_be_stopped_and_started(testbed: Testbed) -> None:
    n3 = testbed.hosts[2]
    n3.stop_docker()
    out = ssh(testbed, n3, ["docker", "info"])
    assert "Cannot connect to the Docker daemon" in out.stderr
    n3.start_docker()
    assert n3.docker(["info", "--format", "{{.ServerVersion}}"]).stdout.strip()


def test_extra_address_comes_and_goes(testbed: Testbed) -> None:
    n3 = testbed.hosts[2]
    n3.add_address("10.88.0.13/24")
    try:
        out = ssh(testbed, n3, ["ip", "-o", "-4", "addr", "show", "eth0"])
        assert "inet 10.88.0.13/24" in out.stdout
    finally:
        n3.remove_address("10.88.0.13/24")
    assert "10.88.0.13" not in n3.run(["ip", "-o", "-4", "addr", "show", "eth0"]).stdout
