"""The machine side of the test bed: commands, processes, network namespaces, packages, and the
removal of what a crashed run left behind. `testbed.py` builds hosts out of these."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path("/var/lib/llmctl-testbed")  # keys, images, docker data roots (kept); run/ (per run)
NETNS_DIR = Path("/var/run/netns")
BRIDGE = "llmbr0"
GATEWAY = "10.77.0.1"
SRV = "/srv/llmctl"
FORWARD_RULE = ["FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"]
HOST_NAME = re.compile(r"llm-n\d+")
SYSTEM_CONTAINERD = Path("/run/containerd/containerd.sock")

TOOLS = ["dockerd", "docker", "sshd", "ssh", "ssh-keygen", "ip", "debootstrap", "iptables"]
TOOLS += ["nsenter", "unshare"]
PACKAGES = ["docker.io", "openssh-server", "iproute2", "debootstrap", "iptables", "util-linux"]


class TestbedError(RuntimeError):
    __test__ = False  # not a pytest test class


class CommandError(subprocess.CalledProcessError):
    """A command failed; unlike CalledProcessError, str() shows what it printed."""

    def __str__(self) -> str:
        out = "\n".join(tail(text) for text in (self.stdout, self.stderr) if text)
        return f"{shlex_join(self.cmd)} exited with {self.returncode}:\n{out}"


def shlex_join(argv: Sequence[str | Path]) -> str:
    return shlex.join(str(a) for a in argv)


def tail(text: str | bytes | None, lines: int = 30) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").rstrip().splitlines()[-lines:])


def run(
    argv: Sequence[str | Path],
    *,
    check: bool = True,
    timeout: float = 120,
    input: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run argv with text output captured; CommandError (with the output) when check fails."""
    argv = [str(a) for a in argv]
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, input=input, env=env
        )
    except subprocess.TimeoutExpired as e:
        output = f"{tail(e.stdout)}\n{tail(e.stderr)}"
        raise TestbedError(
            f"{shlex_join(argv)} did not finish in {timeout:.0f} s:\n{output}"
        ) from None
    if check and proc.returncode != 0:
        raise CommandError(proc.returncode, argv, proc.stdout, proc.stderr)
    return proc


# --- processes ---------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat from the state on (index 0 = state, 19 = start time)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def start_time(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[19] if fields else None


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def stop_pids(pids: Sequence[int], timeout: float, sig: int = signal.SIGTERM) -> None:
    """Send sig, wait up to timeout for them to go, then SIGKILL the rest and wait for that."""
    for s, wait in ((sig, timeout), (signal.SIGKILL, 10.0)):
        for pid in pids:
            if alive(pid):
                try:
                    os.kill(pid, s)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + wait
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not any(alive(p) for p in pids):
            return
    raise TestbedError(f"processes survived SIGKILL: {[cmdline(p) for p in pids if alive(p)]}")


def stop_process(proc: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM a child, SIGKILL after timeout, and reap it."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(10)


def _container_cpu_weight() -> tuple[Path, int, int] | None:
    """The CPU weight file of the parent cgroup of Docker's containers (cgroupfs driver), with
    its normal and lowest values: cgroup v1's cpu.shares or v2's cpu.weight."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.shares").exists():
        return v1 / "docker" / "cpu.shares", 1024, 2
    v2 = Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return v2 / "docker" / "cpu.weight", 100, 1
    return None


def set_priority(pids: Sequence[int], nice: int) -> None:
    """Give these processes, their descendants and Docker's containers a CPU priority: the
    nice value of every thread (Linux keeps one per thread, and what a thread starts inherits
    it), of each one's session (with autogroup scheduling the kernel first shares the CPU
    between sessions, so a thread's own nice value only counts inside its session), and the
    weight of the containers' cgroup (lowest for any positive nice)."""
    weight = _container_cpu_weight()
    if weight is not None:
        path, normal, lowest = weight
        try:
            path.parent.mkdir(exist_ok=True)  # dockerd makes it at its first container
            path.write_text(str(lowest if nice > 0 else normal))
        except OSError:
            pass  # the CPU controller is not enabled below the root
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = _stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    todo, seen = list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo += children.get(pid, [])
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone meanwhile
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        except OSError:
            pass  # a kernel without autogroup scheduling
        for tid in threads:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            except OSError:
                pass  # gone meanwhile


def pids_in_netns(netns: Path) -> list[int]:
    """Live processes whose network namespace is the one bound at netns."""
    try:
        target = os.stat(netns)
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino) and alive(int(entry)):
            found.append(int(entry))
    return found


def wait_for(ready: Callable[[], bool], timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            shown = f"; log {log}:\n{tail(log.read_text(errors='replace'))}" if log else ""
            raise TestbedError(f"{what} not ready after {timeout:.0f} s{shown}")
        time.sleep(0.1)


# --- setup and skip policy ---------------------------------------------------------------------


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def ensure_packages() -> None:
    """apt-get install what the test bed runs, when any of its programs is missing."""
    if all(_which(t) for t in TOOLS):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    if run(install, check=False, timeout=1800, env=env).returncode != 0:
        run(["apt-get", "update"], timeout=600, env=env)
        run(install, timeout=1800, env=env)
    missing = [t for t in TOOLS if not _which(t)]
    if missing:
        raise TestbedError(f"still missing after installing {' '.join(PACKAGES)}: {missing}")


def require_root() -> str | None:
    """Why the test bed cannot run here (a skip reason), or None when it can."""
    if os.geteuid() != 0:
        return "the cluster test bed needs root (network namespaces, sshd, dockerd per host)"
    try:
        probe = run(["unshare", "--net", "true"], check=False, timeout=30)
    except FileNotFoundError:
        return "unshare not found (util-linux): cannot create network namespaces"
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    return None


# --- leftovers of a crashed run ----------------------------------------------------------------


def clear_netns(name: str, warn: bool = False) -> None:
    """Stop every process in the namespace (dockerd gracefully first), then delete it."""
    netns = NETNS_DIR / name
    if not netns.exists():
        return
    pids = pids_in_netns(netns)
    if warn and pids:
        print(f"testbed: {name}: stopping leftover processes: {[cmdline(p) for p in pids]}")
    stop_pids([p for p in pids if comm(p) == "dockerd"], timeout=30)
    stop_pids(pids_in_netns(netns), timeout=5)
    run(["ip", "netns", "delete", name])


def cleanup_leftovers(root: Path = ROOT) -> list[str]:
    """Remove what a previous (crashed) run left; returns what was removed."""
    removed = []
    state = read_state(root)
    recorded = [(int(pid), t) for pid, t, role in state.get("pids", []) if role != "root-dockerd"]
    stale = [pid for pid, t in recorded if alive(pid) and start_time(pid) == t]
    if stale:
        removed.append(f"processes {[cmdline(p) for p in stale]}")
        stop_pids([p for p in stale if comm(p) == "dockerd"], timeout=30)
        stop_pids(stale, timeout=5)
    names = run(["ip", "netns", "list"]).stdout.split()
    for name in [n for n in names if HOST_NAME.fullmatch(n)]:
        removed.append(f"namespace {name}")
        clear_netns(name)
    # A deleted namespace takes its veths with it, but asynchronously: wait, so that the next
    # `ip link add llm-nI-br` does not find the old one.
    deadline = time.monotonic() + 10
    while host_veths() and time.monotonic() < deadline:
        time.sleep(0.05)
    for link in host_veths():  # one whose namespace is gone another way
        removed.append(f"link {link}")
        run(["ip", "link", "delete", link], check=False)
    removed += remove_network()
    for pidfile in Path("/run").glob("docker-llm-n*.pid"):
        pidfile.unlink()
    for exec_root in Path("/run").glob("docker-llm-n*"):
        remove_exec_root(exec_root)
    return removed


def host_veths() -> list[str]:
    links = run(["ip", "-o", "link", "show"]).stdout
    return re.findall(r"^\d+: (llm-n\d+-br)@", links, re.MULTILINE)


def remove_exec_root(path: Path) -> None:
    """A stopped dockerd's runtime state; its mounts were in the host's mount namespace."""
    if path.is_dir() and not mounts_under(path):
        shutil.rmtree(path)


def remove_network() -> list[str]:
    """Delete the bridge and the FORWARD rule; returns what was there."""
    removed = []
    if run(["ip", "link", "show", BRIDGE], check=False).returncode == 0:
        removed.append(f"bridge {BRIDGE}")
        run(["ip", "link", "delete", BRIDGE])
    while run(["iptables", "-C", *FORWARD_RULE], check=False).returncode == 0:
        removed.append("iptables rule")
        run(["iptables", "-D", *FORWARD_RULE])
    return removed


def read_state(root: Path) -> dict:
    try:
        return json.loads((root / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def mounts_under(path: Path) -> list[str]:
    prefix = f"{path}/"
    with open("/proc/self/mountinfo") as f:
        targets = [line.split()[4] for line in f]
    return [t for t in targets if t == str(path) or t.startswith(prefix)]


if __name__ == "__main__":
    # `python tests/e2e/cluster/testbed.py` removes what a crashed run left behind.
    print("\n".join(cleanup_leftovers()) or "nothing to clean up")
