"""One host of the test bed: a network namespace on the bridge, a private mount namespace with its
own /srv/llmctl, an sshd, and optionally a dockerd. `Testbed` starts and stops them."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from testbed_os import (
    BRIDGE,
    GATEWAY,
    NETNS_DIR,
    SRV,
    TestbedError,
    clear_netns,
    comm,
    remove_exec_root,
    run,
    stop_process,
    tail,
    wait_for,
)

if TYPE_CHECKING:
    from testbed import Testbed


class Host:
    """One host of the bed. Commands run in its network and mount namespaces (nsenter)."""

    def __init__(self, bed: Testbed, index: int, has_docker: bool) -> None:
        self.bed = bed
        self.index = index
        self.name = f"llm-n{index}"
        self.ip = f"10.77.0.{10 + index}"
        self.has_docker = has_docker
        self.netns = NETNS_DIR / self.name
        self.veth = f"{self.name}-br"  # the root-namespace end; "eth0" inside
        self.run_dir = bed.run_dir / self.name
        self.srv_dir = self.run_dir / "srv"  # /srv/llmctl inside the host
        self.docker_sock = f"/run/docker-{self.name}.sock"
        self.docker_root = bed.root / f"docker-{self.name}"
        self.exec_root = Path(f"/run/docker-{self.name}")
        self.docker_log = self.run_dir / "dockerd.log"
        self.sshd_log = self.run_dir / "sshd.log"
        self.anchor: subprocess.Popen | None = None
        self.sshd: subprocess.Popen | None = None
        self.dockerd: subprocess.Popen | None = None
        self.extra_addresses: list[str] = []

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.ip}, docker={self.has_docker})"

    @property
    def docker_host(self) -> str:
        return f"unix://{self.docker_sock}"

    def nsenter(self) -> list[str]:
        if self.anchor is None:
            raise TestbedError(f"{self.name} is not started")
        return ["nsenter", f"--net={self.netns}", f"--mount=/proc/{self.anchor.pid}/ns/mnt"]

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 120,
        input: str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv on this host: its network and mount namespaces, DOCKER_HOST set to its
        daemon, working directory /. Output is text; CommandError (with it) when check fails."""
        env = {**os.environ, "DOCKER_HOST": self.docker_host, **(env or {})}
        return run([*self.nsenter(), *argv], check=check, timeout=timeout, input=input, env=env)

    def docker(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self.run(["docker", *argv], check=check, timeout=timeout)

    # -- lifecycle (called by Testbed) --

    def create_network(self) -> None:
        run(["ip", "netns", "add", self.name])
        veth = ["type", "veth", "peer", "name", "eth0", "netns", self.name]
        run(["ip", "link", "add", self.veth, *veth])
        run(["ip", "link", "set", self.veth, "master", BRIDGE, "up"])
        ns = ["ip", "-n", self.name]
        run([*ns, "addr", "add", f"{self.ip}/24", "dev", "eth0"])
        run([*ns, "link", "set", "eth0", "up"])
        run([*ns, "link", "set", "lo", "up"])
        run([*ns, "route", "add", "default", "via", GATEWAY])
        # No name server answers from the bed (its queries leave unNATed and are lost): refuse
        # them at once, as a network whose resolver is down does, rather than let every lookup of
        # a name or address outside /etc/hosts wait out the resolver's 2 x 5 s (torch's c10d
        # looks up its peers' addresses: that was 10 s of each group's start).
        for proto, reject in (("udp", "icmp-port-unreachable"), ("tcp", "tcp-reset")):
            rule = ["OUTPUT", "-p", proto, "--dport", "53", "-j", "REJECT", "--reject-with", reject]
            run(["ip", "netns", "exec", self.name, "iptables", "-A", *rule])

    def start_anchor(self) -> None:
        """The long-lived process that holds the host's private mount namespace."""
        self.srv_dir.mkdir(parents=True, exist_ok=True)
        argv = ["nsenter", f"--net={self.netns}", "unshare", "--mount", "--propagation", "private"]
        script = 'mount --bind "$1" "$2" && exec sleep infinity'
        argv += ["sh", "-c", script, "sh", self.srv_dir, SRV]
        self.anchor = self.bed.spawn(argv, self.run_dir / "anchor.log", f"{self.name}-anchor")
        anchor = self.anchor
        # `exec sleep` happens only once the bind mount is in place.
        ready = lambda: anchor.poll() is not None or comm(anchor.pid) == "sleep"  # noqa: E731
        wait_for(ready, 10, f"{self.name} mount namespace")
        if anchor.poll() is not None:
            log = (self.run_dir / "anchor.log").read_text()
            raise TestbedError(f"{self.name}: mount namespace anchor exited: {log}")

    def write_sshd_config(self) -> Path:
        config = self.run_dir / "sshd_config"
        config.write_text(
            f"ListenAddress {self.ip}\n"
            "Port 22\n"
            f"HostKey {self.bed.host_key(self.name)}\n"
            f"PidFile {self.run_dir / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {self.bed.authorized_keys}\n"
            "PermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "PrintMotd no\n"
            "MaxStartups 100\n"
            "Subsystem sftp /usr/lib/openssh/sftp-server\n"
            f"SetEnv DOCKER_HOST={self.docker_host}\n"
        )
        return config

    def start_sshd(self) -> None:
        config = self.write_sshd_config()
        # -D: stay in the foreground so the Popen is sshd itself; -E: log to a file (no syslog).
        self.sshd = self.bed.spawn(
            [*self.nsenter(), "/usr/sbin/sshd", "-D", "-E", self.sshd_log, "-f", config],
            self.run_dir / "sshd.out",
            f"{self.name}-sshd",
        )

    def wait_sshd(self) -> None:
        sshd = self.sshd
        if sshd is None:
            raise TestbedError(f"{self.name}: sshd was not started")

        def ready() -> bool:
            if sshd.poll() is not None:
                raise TestbedError(f"{self.name}: sshd exited: {tail(self.sshd_log.read_text())}")
            try:
                with socket.create_connection((self.ip, 22), timeout=1) as s:
                    return s.recv(4) == b"SSH-"
            except OSError:
                return False

        wait_for(ready, 20, f"{self.name} sshd", self.sshd_log)

    def start_docker(self) -> None:
        """Start this host's dockerd and wait until it answers."""
        if not self.has_docker:
            raise TestbedError(f"{self.name} is a host without Docker")
        if self.dockerd is not None and self.dockerd.poll() is None:
            return
        argv = [*self.nsenter(), "dockerd", "-H", self.docker_host, "--data-root", self.docker_root]
        argv += ["--exec-root", self.exec_root, "--pidfile", f"/run/docker-{self.name}.pid"]
        argv += ["--bridge", "none", "--iptables=false", "--ip6tables=false"]
        self.dockerd = self.bed.spawn(argv, self.docker_log, f"{self.name}-dockerd")
        dockerd = self.dockerd

        def ready() -> bool:
            if dockerd.poll() is not None:
                raise TestbedError(
                    f"{self.name}: dockerd exited with {dockerd.returncode}; "
                    f"log {self.docker_log}:\n{tail(self.docker_log.read_text())}"
                )
            probe = ["docker", "-H", self.docker_host, "info", "--format", "{{.ServerVersion}}"]
            return run(probe, check=False, timeout=20).returncode == 0

        wait_for(ready, 90, f"{self.name} dockerd", self.docker_log)

    def stop_docker(self, timeout: float = 30) -> None:
        """Stop this host's dockerd (SIGTERM; SIGKILL after timeout). Its containers stop too."""
        stop_process(self.dockerd, timeout)
        self.dockerd = None

    @property
    def docker_running(self) -> bool:
        return self.dockerd is not None and self.dockerd.poll() is None

    def remove_containers(self) -> None:
        ids = self.docker(["ps", "-aq"], timeout=60).stdout.split()
        if ids:
            self.docker(["rm", "-f", *ids], timeout=180)

    def add_address(self, cidr: str) -> None:
        """Give eth0 one more address, e.g. "10.88.0.13/24" (gone with the host)."""
        run(["ip", "-n", self.name, "addr", "add", cidr, "dev", "eth0"])
        self.extra_addresses.append(cidr)

    def remove_address(self, cidr: str) -> None:
        run(["ip", "-n", self.name, "addr", "del", cidr, "dev", "eth0"])
        self.extra_addresses.remove(cidr)

    def stop(self) -> list[str]:
        """Stop everything of this host; returns what went wrong (teardown goes on regardless)."""
        errors = []
        steps: list[tuple[str, Callable[[], object]]] = []
        if self.docker_running:
            steps.append(("remove containers", self.remove_containers))
        steps += [
            ("stop dockerd", self.stop_docker),
            ("stop sshd", lambda: stop_process(self.sshd, 10)),
            ("stop anchor", lambda: stop_process(self.anchor, 10)),
            ("clear namespace", lambda: clear_netns(self.name, warn=True)),
            ("remove exec root", lambda: remove_exec_root(self.exec_root)),
        ]
        for what, step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - teardown reports and goes on
                errors.append(f"{self.name}: {what}: {e}")
        return errors
