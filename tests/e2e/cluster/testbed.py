"""A test bed of real hosts on this machine, for end-to-end tests of the cluster launcher.

Host i (1-based), named llm-nI, is:
  network  namespace llm-nI; eth0 = 10.77.0.(10+i)/24 on the bridge llmbr0 (10.77.0.1 in the root
           namespace), lo up, default route via 10.77.0.1; DNS queries refused at once (no
           name server answers from the bed: names are in each container's /etc/hosts);
  mounts   a private mount namespace, anchored by a `sleep infinity`, where /srv/llmctl is the
           host's own directory (`host.srv_dir` seen from outside); the rest of the file system is
           shared with this machine;
  sshd     on 10.77.0.(10+i):22, root login with `testbed.client_key`, DOCKER_HOST set in sessions;
  dockerd  (optional) on unix:///run/docker-llm-nI.sock, own containerd; its data root is kept
           between runs as the image cache.

Everything started is recorded (Popen objects, and pids in a state file) and stopped by that record.
A crashed run's leftovers (namespaces and every process inside them, veths, the bridge, the
iptables rule, recorded pids) are removed by the next start, so a crash never blocks a run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import testbed_image
from testbed_host import Host
from testbed_os import (
    BRIDGE,
    FORWARD_RULE,
    GATEWAY,
    ROOT,
    SRV,
    SYSTEM_CONTAINERD,
    CommandError,
    TestbedError,
    alive,
    cleanup_leftovers,
    comm,
    ensure_packages,
    mounts_under,
    read_state,
    remove_network,
    require_root,
    run,
    shlex_join,
    start_time,
    stop_pids,
    stop_process,
    wait_for,
)

__all__ = ["CommandError", "Host", "Testbed", "TestbedError", "ensure_packages", "require_root"]


class Testbed:
    """N real hosts on this machine. `with Testbed(4, docker=[True, True, True, False]) as bed:`"""

    __test__ = False  # not a pytest test class

    def __init__(self, hosts: int = 4, docker: bool | Sequence[bool] = True, root: Path = ROOT):
        if not 1 <= hosts <= 50:
            raise ValueError(f"hosts={hosts}: use 1 to 50")
        flags = [docker] * hosts if isinstance(docker, bool) else list(docker)
        if len(flags) != hosts:
            raise ValueError(f"docker has {len(flags)} flags for {hosts} hosts")
        self.root = root
        self.run_dir = root / "run"  # wiped on start; logs stay after close for post-mortems
        self.client_key = root / "keys" / "client_ed25519"
        self.authorized_keys = self.run_dir / "authorized_keys"
        self.known_hosts = self.run_dir / "known_hosts"
        self.hosts = [Host(self, i + 1, flag) for i, flag in enumerate(flags)]
        self._pids: list[tuple[int, str | None, str]] = []  # (pid, start time, role)
        self._state_lock = threading.Lock()
        # Set when this bed started the root daemon (or adopted one a crashed bed started).
        self._root_dockerd: int | None = None
        self._root_dockerd_proc: subprocess.Popen | None = None
        self._started = False

    def __enter__(self) -> Testbed:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def docker_hosts(self) -> list[Host]:
        return [h for h in self.hosts if h.has_docker]

    def process_ids(self) -> list[int]:
        """The processes this bed started (or adopted), for set_priority."""
        with self._state_lock:
            pids = [pid for pid, _, _ in self._pids]
        return pids + [self._root_dockerd] if self._root_dockerd else pids

    def host_key(self, name: str) -> Path:
        return self.root / "keys" / f"host-{name}_ed25519"

    def ssh_argv(self, host: Host, argv: Sequence[str], user: str = "root") -> list[str]:
        """`ssh` to host as user with the client key, host keys checked, running argv."""
        ssh = ["ssh", "-i", str(self.client_key), "-o", f"UserKnownHostsFile={self.known_hosts}"]
        ssh += ["-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
        return [*ssh, f"{user}@{host.ip}", shlex_join(argv)]

    def spawn(self, argv: Sequence[str | Path], log: Path, role: str) -> subprocess.Popen:
        """Start a long-lived process (own session, output to log) and record its pid."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [str(a) for a in argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # pytest's Ctrl-C reaches the bed's teardown, not them
            )
        with self._state_lock:
            self._pids.append((proc.pid, start_time(proc.pid), role))
        self._write_state()
        return proc

    def _write_state(self) -> None:
        with self._state_lock:  # hosts start their daemons from threads
            pid = self._root_dockerd
            state = {"pids": self._pids, "root_dockerd": pid and (pid, start_time(pid))}
            tmp = self.root / "state.json.tmp"
            tmp.write_text(json.dumps(state))
            tmp.replace(self.root / "state.json")

    # -- start --

    def start(self) -> None:
        t0 = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        previous = read_state(self.root)
        pid, started = previous.get("root_dockerd") or (None, None)
        if pid and alive(pid) and start_time(pid) == started and comm(pid) == "dockerd":
            self._root_dockerd = pid  # an earlier bed started it and crashed: this one owns it
        self._started = True
        try:
            removed = cleanup_leftovers(self.root)
            if removed:
                print(f"testbed: removed leftovers of an earlier run: {', '.join(removed)}")
            self._start()
        except BaseException:
            self.close()
            raise
        print(f"testbed: {len(self.hosts)} hosts up in {time.monotonic() - t0:.1f} s")

    def _start(self) -> None:
        if any(h.has_docker for h in self.hosts) and SYSTEM_CONTAINERD.exists():
            # dockerd would use it instead of its own containerd, whose network namespace is the
            # host's: containers would then run in the root namespace.
            raise TestbedError(f"{SYSTEM_CONTAINERD} exists; stop the system containerd first")
        if mounts_under(self.run_dir):
            raise TestbedError(f"mounts under {self.run_dir}; unmount them first")
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        Path(SRV).mkdir(parents=True, exist_ok=True)
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        self._write_state()
        self._ensure_root_docker()
        self._make_keys()

        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE])
        run(["ip", "link", "set", BRIDGE, "up"])
        # The root dockerd sets FORWARD's policy to DROP, which blocks host-to-host traffic.
        run(["iptables", "-I", *FORWARD_RULE])
        for host in self.hosts:
            host.create_network()
            host.start_anchor()
            host.start_sshd()
        with ThreadPoolExecutor(len(self.hosts)) as pool:
            list(pool.map(lambda h: h.wait_sshd(), self.hosts))
            list(pool.map(self._start_host_docker, self.docker_hosts))

    def _start_host_docker(self, host: Host) -> None:
        host.start_docker()
        host.remove_containers()  # the data root is kept; containers of earlier runs are not

    def _ensure_root_docker(self) -> None:
        if run(["docker", "info"], check=False, timeout=60).returncode == 0:
            return
        log = self.run_dir / "dockerd-root.log"
        proc = self.spawn(["dockerd"], log, "root-dockerd")
        self._root_dockerd, self._root_dockerd_proc = proc.pid, proc
        self._write_state()
        answers = lambda: run(["docker", "info"], check=False).returncode == 0  # noqa: E731
        wait_for(answers, 90, "the root dockerd", log)

    def _make_keys(self) -> None:
        (self.root / "keys").mkdir(exist_ok=True)
        paths = [self.client_key, *(self.host_key(h.name) for h in self.hosts)]
        for path in paths:
            if not path.exists():
                run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", path])
        if not Path("/etc/ssh/ssh_host_ed25519_key").exists():
            run(["ssh-keygen", "-A"])
        self.authorized_keys.write_text(self.client_key.with_suffix(".pub").read_text())
        lines = []
        for h in self.hosts:
            kind, key = self.host_key(h.name).with_suffix(".pub").read_text().split()[:2]
            lines.append(f"{h.ip} {kind} {key}\n")
        self.known_hosts.write_text("".join(lines))

    # -- images --

    def image_file(self, tag: str) -> Path:
        """The root daemon's `tag` as a `docker save` tar, cached per image id."""
        return testbed_image.image_file(self.root, tag)

    def load_image(self, tag: str) -> None:
        """Give every Docker host the root daemon's `tag` (same image id), loading the cached
        tar (in parallel) only where it is missing or different."""
        testbed_image.load(self.root, tag, [h.docker_host for h in self.docker_hosts])

    # -- teardown --

    def close(self) -> None:
        """Stop and remove everything this bed started. Safe to call twice."""
        if not self._started:
            return
        t0 = time.monotonic()
        errors: list[str] = []
        with ThreadPoolExecutor(len(self.hosts)) as pool:
            for host_errors in pool.map(Host.stop, self.hosts):
                errors += host_errors
        try:
            remove_network()
            if self._root_dockerd_proc is not None:
                stop_process(self._root_dockerd_proc, 30)
            elif self._root_dockerd is not None:
                stop_pids([self._root_dockerd], timeout=30)
        except Exception as e:  # noqa: BLE001 - teardown reports and goes on
            errors.append(str(e))
        self._root_dockerd = self._root_dockerd_proc = None
        self._pids = []
        self._write_state()
        self._started = False
        print(f"testbed: closed in {time.monotonic() - t0:.1f} s")
        if errors:
            raise TestbedError("teardown problems:\n" + "\n".join(errors))
