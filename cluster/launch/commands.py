"""Every command the launcher runs on a node, as an argv list built by a pure function.

Nothing here executes anything: `launcher.py` hands these lists to a Transport, and `--dry-run`
prints them with `shlex.join`. User values (paths, names, addresses) are argv elements, never
pieces of a shell string.
"""

from __future__ import annotations

RAY_PORT = 6379
DEFAULT_SHM_SIZE = "10.24g"  # the seeds' --shm-size: NCCL and torch share memory through it
HF_HOME_IN_CONTAINER = "/root/.cache/huggingface"
LABEL_CLUSTER = "llmctl.cluster"
LABEL_ROLE = "llmctl.role"
LABEL_CONFIG = "llmctl.config-hash"
LABEL_BACKEND = "llmctl.backend"  # "mp" on the containers of `cluster up --backend mp`
# `cluster up --backend`: ray (a Ray cluster in the containers) or mp (no Ray: the containers wait
# for `llmctl serve -i --backend mp`, which starts each node's part of the mp group in them).
BACKENDS = ("ray", "mp")

# Printed inside a container: the versions `cluster status` and `doctor` compare across nodes.
VERSIONS_SCRIPT = """\
import json, platform, importlib.metadata as m
def v(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
print(json.dumps({"python": platform.python_version(), "torch": v("torch"), "ray": v("ray"),
                  "llmctl": v("llmctl")}))
"""


def ray_start_argv(
    role: str, node_ip: str, head_ip: str, gpus: int | None, port: int = RAY_PORT
) -> list[str]:
    """`ray start --block` for a head or a worker, its node IP forced to VLLM_HOST_IP."""
    argv = ["ray", "start", "--block", f"--node-ip-address={node_ip}", "--disable-usage-stats"]
    if role == "head":
        argv += ["--head", f"--port={port}"]
    else:
        argv += [f"--address={head_ip}:{port}"]
    if gpus is not None:
        argv.append(f"--num-gpus={gpus}")
    return argv


def idle_argv() -> list[str]:
    """An mp node's container command: nothing runs until `serve -i` execs llmctl in it (with
    `docker run --init`, whose init reaps what those leave and stops on SIGTERM)."""
    return ["sleep", "infinity"]


def docker_info_argv() -> list[str]:
    return ["docker", "info", "--format", "{{.ServerVersion}} {{json .Runtimes}}"]


def image_id_argv(image: str) -> list[str]:
    return ["docker", "image", "inspect", "--format", "{{.Id}}", image]


def docker_load_argv(path: str) -> list[str]:
    return ["docker", "load", "--input", path]


def image_ids_argv() -> list[str]:
    return ["docker", "image", "ls", "--quiet", "--no-trunc"]


def image_layers_argv(ids: list[str]) -> list[str]:
    """One line per image: its layers' diff ids as JSON, lowest first."""
    return ["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", *ids]


def docker_inspect_argv(container: str) -> list[str]:
    return ["docker", "container", "inspect", container]


def docker_rm_argv(container: str) -> list[str]:
    return ["docker", "rm", "--force", container]


def docker_logs_argv(container: str, tail: int | None = None) -> list[str]:
    argv = ["docker", "logs"]
    if tail is not None:
        argv += ["--tail", str(tail)]
    return argv + [container]


def docker_exec_argv(container: str, command: list[str]) -> list[str]:
    return ["docker", "exec", container, *command]


def ip_addr_argv() -> list[str]:
    return ["ip", "-o", "addr", "show"]


def statfs_argv(path: str) -> list[str]:
    """The filesystem's fragment size and block count (statvfs's f_frsize, f_blocks)."""
    return ["stat", "--file-system", "--format", "%S %b", path]


def model_listing_argv(model: str) -> list[str]:
    """Name and size of each file of a model directory (or of a single GGUF file). Symlinks are
    followed: a Hugging Face cache snapshot is a folder of links into its blobs."""
    return ["find", "-L", model, "-maxdepth", "1", "-type", "f", "-printf", "%f\\t%s\\n"]


def sha256_argv(paths: list[str]) -> list[str]:
    return ["sha256sum", "--", *paths]


def ray_status_argv(container: str) -> list[str]:
    return docker_exec_argv(container, ["ray", "status"])


def ray_list_nodes_argv(container: str) -> list[str]:
    return docker_exec_argv(
        container, ["ray", "list", "nodes", "--format", "json", "--limit", "1000"]
    )


def versions_argv(container: str) -> list[str]:
    return docker_exec_argv(container, ["python3", "-c", VERSIONS_SCRIPT])
