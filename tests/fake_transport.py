"""A recording fake Transport for pure tests of the cluster code (no SSH, no Docker, no root).

`FakeTransport` answers each argv by the first matching pattern (a regex searched in
`shlex.join(argv)`; the latest `reply` wins) and records every argv it ran and every file it
wrote. `docker_node` gives one a small Docker: `docker run` creates a running container with the
argv's labels, `docker rm --force` removes it, `docker container inspect` shows it, so a second
`cluster up` sees what the first one started.
"""

from __future__ import annotations

import io
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from hashlib import sha256

from llmctl.cluster.launch.transport import COMMAND_NOT_FOUND, CommandResult

Reply = str | tuple[int, str, str] | Callable[[list[str]], "str | tuple[int, str, str]"]


@dataclass
class FakeTransport:
    name: str
    home_dir: str = "/root"
    calls: list[list[str]] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    _replies: list[tuple[re.Pattern[str], Reply]] = field(default_factory=list)

    def reply(self, pattern: str, reply: Reply) -> FakeTransport:
        """Answer argv matching `pattern` with stdout (str), (returncode, stdout, stderr), or
        what a function of the argv returns."""
        self._replies.insert(0, (re.compile(pattern), reply))
        return self

    def run(
        self, argv: list[str], *, timeout: float = 60.0, input: str | None = None
    ) -> CommandResult:
        self.calls.append(list(argv))
        line = shlex.join(argv)
        for pattern, reply in self._replies:
            if pattern.search(line):
                answer = reply(list(argv)) if callable(reply) else reply
                code, out, err = (0, answer, "") if isinstance(answer, str) else answer
                return CommandResult(tuple(argv), code, out, err)
        return CommandResult(tuple(argv), COMMAND_NOT_FOUND, "", f"{argv[0]}: command not found")

    def ran(self, pattern: str) -> list[list[str]]:
        """The recorded argvs matching `pattern`."""
        return [argv for argv in self.calls if re.search(pattern, shlex.join(argv))]

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.calls.append(["(write)", path, oct(mode)])
        self.files[path] = data

    def open(self, path: str, mode: str = "rb"):
        if path not in self.files:
            raise FileNotFoundError(path)
        return io.BytesIO(self.files[path])

    def makedirs(self, path: str) -> None:
        pass

    def home(self) -> str:
        return self.home_dir

    def close(self) -> None:
        pass


def docker_node(
    name: str,
    ip: str,
    *,
    hostname: str | None = None,
    image_id: str = "sha256:aa",
    model: dict[str, str] | None = None,
) -> FakeTransport:
    """A node with Docker, the image, one address `ip/24` on eth0 and, when given, the model's
    files ({name: content}) under any path."""
    fake = FakeTransport(name)
    containers: dict[str, dict] = {}

    def inspect(argv: list[str]):
        state = containers.get(argv[-1])
        return (0, json.dumps([state]), "") if state else (1, "[]", f"No such object: {argv[-1]}")

    def run(argv: list[str]):
        container = argv[argv.index("--name") + 1]
        labels = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--label")
        containers[container] = {
            "Name": f"/{container}", "Image": image_id,
            "State": {"Status": "running", "Running": True, "ExitCode": 0},
            "Config": {"Labels": labels},
        }  # fmt: skip
        return f"{len(containers):064x}\n"

    def rm(argv: list[str]):
        return "" if containers.pop(argv[-1], None) else (1, "", f"No such container: {argv[-1]}")

    fake.reply(r"^uname -n$", f"{hostname or name}\n")
    fake.reply(r"^docker info", '24.0.7 {"runc":{"path":"runc"}}\n')
    fake.reply(
        r"^ip -o addr show$",
        "1: lo    inet 127.0.0.1/8 scope host lo\\\n"
        f"2: eth0    inet {ip}/24 brd {ip.rsplit('.', 1)[0]}.255 scope global eth0\\\n",
    )
    fake.reply(r"^docker image inspect", f"{image_id}\n")
    fake.reply(r"^docker container inspect", inspect)
    fake.reply(r"^docker run ", run)
    fake.reply(r"^docker rm --force", rm)
    files = model or {}
    fake.reply(r"^find -L", "".join(f"{n}\t{len(c)}\n" for n, c in files.items()))
    fake.reply(r"^sha256sum", lambda argv: "".join(
        f"{sha256(files[p.rsplit('/', 1)[-1]].encode()).hexdigest()}  {p}\n" for p in argv[2:]
    ))  # fmt: skip
    fake.containers = containers  # type: ignore[attr-defined]
    return fake
