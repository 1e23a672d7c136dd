"""Transports: how the launcher runs a command or writes a file on a node.

One small interface (`run(argv)`, `write_file`, `open`, `makedirs`) with two real implementations:
`LocalTransport` (this machine, `subprocess`) and `SSHTransport` (paramiko). Commands are argv
lists; over SSH they travel as `shlex.join(argv)`, so no user value is ever parsed by a shell.

Host keys: SSHTransport keeps OpenSSH's `accept-new` behaviour. A host seen for the first time is
recorded in the known-hosts file (`$LLMCTL_KNOWN_HOSTS`, default ~/.ssh/known_hosts); a host
whose key changed is refused (SSHAuthError), as `ssh` would.
"""

from __future__ import annotations

import errno
import os
import shlex
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from llmctl.cluster.errors import HostUnreachableError, RemoteCommandError, SSHAuthError
from llmctl.engine import envs

COMMAND_NOT_FOUND = 127  # the exit status a shell gives a missing program


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def error_line(self) -> str:
        """The last non-empty line of stderr (or stdout): what a user needs to see."""
        for text in (self.stderr, self.stdout):
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            if lines:
                return lines[-1]
        return f"exit status {self.returncode}"


class Transport(Protocol):
    """A node the launcher can run commands on."""

    name: str  # how messages name the node (its inventory host)

    def run(
        self, argv: list[str], *, timeout: float = 60.0, input: str | None = None
    ) -> CommandResult:
        """Run argv to completion; a non-zero exit is a result, not an exception."""
        ...

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None: ...

    def open(self, path: str, mode: str = "rb") -> IO[bytes]: ...

    def makedirs(self, path: str) -> None: ...

    def home(self) -> str: ...

    def close(self) -> None: ...


def check(result: CommandResult, node: str, what: str) -> CommandResult:
    """`result`, or RemoteCommandError naming the node, the command and its error line."""
    if not result.ok:
        raise RemoteCommandError(
            f"{what} failed on {node}: {result.error_line()}",
            f"the command was: {shlex.join(result.argv)}",
        )
    return result


class LocalTransport:
    """This machine: commands through subprocess, files through the local filesystem."""

    def __init__(self, name: str = "localhost") -> None:
        self.name = name

    def run(
        self, argv: list[str], *, timeout: float = 60.0, input: str | None = None
    ) -> CommandResult:
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, input=input, check=False
            )
        except FileNotFoundError:
            return CommandResult(
                tuple(argv), COMMAND_NOT_FOUND, "", f"{argv[0]}: command not found"
            )
        except subprocess.TimeoutExpired:
            raise RemoteCommandError(
                f"{shlex.join(argv)} did not finish within {timeout:.0f} s on {self.name}",
                "check the node's load, or raise the timeout",
            ) from None
        return CommandResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        target = Path(path).expanduser()
        target.parent.mkdir(parents=True, exist_ok=True)
        # Create with the final mode, so a secret is never readable by others, even briefly.
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(target, mode)

    def open(self, path: str, mode: str = "rb") -> IO[bytes]:
        return open(Path(path).expanduser(), mode)  # noqa: SIM115 - the caller closes it

    def makedirs(self, path: str) -> None:
        Path(path).expanduser().mkdir(parents=True, exist_ok=True)

    def home(self) -> str:
        return str(Path.home())

    def close(self) -> None:
        pass


def known_hosts_path() -> Path:
    return Path(envs.LLMCTL_KNOWN_HOSTS).expanduser()


class SSHTransport:
    """A node over SSH (paramiko): one connection, opened on first use, many channels."""

    def __init__(
        self,
        host: str,
        *,
        user: str = "root",
        port: int = 22,
        key: str | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        self.name = host
        self.host, self.user, self.port = host, user, port
        self.key = str(Path(key).expanduser()) if key else None
        self.connect_timeout = connect_timeout
        self._client = None
        self._sftp = None
        self._home: str | None = None
        self._lock = threading.Lock()

    # -- connection -------------------------------------------------------------------------
    def _connect(self):
        with self._lock:
            if self._client is not None:
                return self._client
            import paramiko

            client = paramiko.SSHClient()
            known = known_hosts_path()
            known.parent.mkdir(parents=True, exist_ok=True)
            known.touch(mode=0o600, exist_ok=True)
            client.load_host_keys(str(known))  # AutoAddPolicy saves new keys here
            client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
            where = f"{self.user}@{self.host}:{self.port}"
            if self.key and not Path(self.key).is_file():
                raise SSHAuthError(
                    f"the SSH key {self.key} for {where} does not exist",
                    "fix `ssh.key` in the inventory",
                )
            try:
                client.connect(
                    self.host,
                    port=self.port,
                    username=self.user,
                    key_filename=self.key,
                    look_for_keys=self.key is None,
                    allow_agent=self.key is None,
                    timeout=self.connect_timeout,
                    banner_timeout=self.connect_timeout,
                    auth_timeout=self.connect_timeout,
                )
            except paramiko.BadHostKeyException:
                raise SSHAuthError(
                    f"the host key of {self.host} changed since it was recorded in {known}",
                    f"if the node was reinstalled, remove its line: ssh-keygen -R {self.host}"
                    f" -f {known}",
                ) from None
            except paramiko.AuthenticationException:
                key = self.key or "your default keys and agent"
                raise SSHAuthError(
                    f"{where} rejected the SSH key {key}",
                    "set `ssh.key` (and `ssh.user`) in the inventory to a key the node accepts",
                ) from None
            except TimeoutError:
                raise HostUnreachableError(
                    f"cannot reach {where}: timed out after {self.connect_timeout:.0f} s",
                    "check the address, that the node is up and that sshd listens there",
                ) from None
            except socket.gaierror as exc:
                raise HostUnreachableError(
                    f"cannot resolve {self.host}: {exc.strerror}", "fix `host:` in the inventory"
                ) from None
            except OSError as exc:
                reason = exc.strerror or str(exc) or errno.errorcode.get(exc.errno or 0, "?")
                raise HostUnreachableError(
                    f"cannot reach {where}: {reason}",
                    "check the address, that the node is up and that sshd listens there",
                ) from None
            except paramiko.SSHException as exc:
                raise HostUnreachableError(
                    f"SSH to {where} failed: {exc}", "check that sshd runs on that port"
                ) from None
            self._client = client
            return client

    def connect(self) -> None:
        self._connect()

    def _sftp_client(self):
        client = self._connect()
        with self._lock:
            if self._sftp is None:
                self._sftp = client.open_sftp()
            return self._sftp

    # -- Transport --------------------------------------------------------------------------
    def run(
        self, argv: list[str], *, timeout: float = 60.0, input: str | None = None
    ) -> CommandResult:
        client = self._connect()
        channel = client.get_transport().open_session()
        channel.exec_command(shlex.join(argv))
        if input is not None:
            channel.sendall(input.encode())
        channel.shutdown_write()
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + timeout
        # Drain both streams while the command runs: a full stderr window would block it.
        while True:
            busy = False
            while channel.recv_ready():
                out += channel.recv(65536)
                busy = True
            while channel.recv_stderr_ready():
                err += channel.recv_stderr(65536)
                busy = True
            # sshd may send the exit status before the last output: done at EOF, not at exit.
            done = channel.exit_status_ready() and (channel.eof_received or channel.closed)
            if done and not channel.recv_ready() and not channel.recv_stderr_ready():
                break
            if time.monotonic() > deadline:
                channel.close()
                raise RemoteCommandError(
                    f"{shlex.join(argv)} did not finish within {timeout:.0f} s on {self.name}",
                    "check the node's load, or raise the timeout",
                )
            if not busy:
                time.sleep(0.005)
        status = channel.recv_exit_status()
        channel.close()
        # A missing program: the remote shell says "command not found" with status 127.
        return CommandResult(
            tuple(argv), status, out.decode(errors="replace"), err.decode(errors="replace")
        )

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        sftp = self._sftp_client()
        self.makedirs(os.path.dirname(path))
        with sftp.open(path, "wb") as f:
            f.chmod(mode)  # before the content: a secret is never readable by others
            f.write(data)

    def open(self, path: str, mode: str = "rb") -> IO[bytes]:
        handle = self._sftp_client().open(path, mode)
        if "r" in mode:
            handle.prefetch()
        return handle

    def makedirs(self, path: str) -> None:
        if not path:
            return
        sftp = self._sftp_client()
        parts = Path(path).parts
        current = ""
        for part in parts:
            current = part if not current else os.path.join(current, part)
            try:
                sftp.stat(current)
            except FileNotFoundError:
                sftp.mkdir(current)

    def home(self) -> str:
        if self._home is None:
            result = check(self.run(["printenv", "HOME"]), self.name, "reading $HOME")
            self._home = result.stdout.strip() or "/root"
        return self._home

    def close(self) -> None:
        with self._lock:
            if self._sftp is not None:
                self._sftp.close()
            if self._client is not None:
                self._client.close()
            self._client = self._sftp = None
