"""KubeOptions: how to run a plan on Kubernetes (`llmctl plan --emit KIND`), validated once;
EmitFlags: the same options as the user gives them on the command line, declared once
(config/options.py's OptionSpec). The manifests themselves are built in manifests.py."""

from __future__ import annotations

import dataclasses
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from llmctl.cluster.errors import ConfigError
from llmctl.engine.config.options import PLAN, option

EMIT_KINDS = ("lws", "raycluster", "rayservice", "kuberay")  # kuberay: the RayService
DEFAULT_IMAGE = "llmctl:latest"  # `llmctl image build`'s default tag
DEFAULT_PORT = 8000
DEFAULT_MASTER_PORT = 29501  # the mp backend's own default (ParallelConfig.master_port)
DEFAULT_SHM_SIZE = "10Gi"
DEFAULT_SOCKET_IFNAME = "eth0"  # a pod's interface on the cluster network
_LWS_ONLY = {"master_port": "--master-port"}
_RAY_ONLY = {"ray_version": "--ray-version"}
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_NAME_MAX = 40  # KubeRay and LWS derive pod and Service names from it (63 at most)


@dataclass(frozen=True)
class KubeOptions:
    """How to run a plan on Kubernetes. Validated once here: bad combinations name the fix."""

    kind: str
    name: str
    image: str = DEFAULT_IMAGE
    namespace: str | None = None
    port: int = DEFAULT_PORT
    model_path: str | None = None  # the model inside the pod; None: the image's bundled model
    model_host_path: str | None = None  # the node's directory mounted at the model's directory
    model_pvc: str | None = None  # ... or a PersistentVolumeClaim holding it
    shm_size: str = DEFAULT_SHM_SIZE
    socket_ifname: str = DEFAULT_SOCKET_IFNAME
    master_port: int | None = None  # lws only (default DEFAULT_MASTER_PORT)
    ray_version: str | None = None  # raycluster/rayservice only: the image's Ray, for KubeRay

    def __post_init__(self) -> None:
        if self.kind not in EMIT_KINDS:
            raise ConfigError(
                f"unknown --emit kind {self.kind!r}",
                "use --emit lws (LeaderWorkerSet, mp backend), --emit rayservice (KubeRay and "
                "Ray Serve) or --emit raycluster (KubeRay)",
            )
        only, other = (_RAY_ONLY, "raycluster") if self.kind == "lws" else (_LWS_ONLY, "lws")
        given = [flag for name, flag in only.items() if getattr(self, name) is not None]
        if given:
            raise ConfigError(
                f"{', '.join(given)} applies to --emit {other}, not --emit {self.kind}",
                f"drop {', '.join(given)}, or use --emit {other}",
            )
        if not _NAME.fullmatch(self.name) or len(self.name) > _NAME_MAX:
            raise ConfigError(
                f"--name {self.name!r} is not a Kubernetes name",
                f"use lower-case letters, digits and '-', starting with a letter, at most "
                f"{_NAME_MAX} characters",
            )
        if self.model_host_path and self.model_pvc:
            raise ConfigError(
                "--model-host-path and --model-pvc both give the model's volume",
                "keep one of them",
            )
        if self.model_path is None and (self.model_host_path or self.model_pvc):
            raise ConfigError(
                "a model volume without a model: the image's bundled model needs none",
                "give MODEL (and --model-path for where it is in the pod), or drop the volume",
            )
        if self.model_path is not None and not posixpath.isabs(self.model_path):
            raise ConfigError(
                f"--model-path {self.model_path!r} is not an absolute path",
                "give the model's path inside the pod, e.g. /models/Llama-3.1-8B",
            )
        volume = self.model_host_path or self.model_pvc
        if volume and self.model_path and posixpath.dirname(self.model_path) == "/":
            raise ConfigError(
                f"--model-path {self.model_path} is at the root: its volume would be mounted "
                "over the pod's /",
                f"put it in a directory, e.g. --model-path /models{self.model_path}",
            )
        for label, port in (("--port", self.port), ("--master-port", self.master_port)):
            if port is not None and not 0 < port < 65536:
                raise ConfigError(f"{label} {port} is not a port", f"use {label} 1-65535")


def default_name(model: str) -> str:
    """ "llmctl-llama-3-1-70b" for Llama-3.1-70B (or /models/Llama-3.1-70B)."""
    base = posixpath.basename(model.rstrip("/")).lower()
    base = re.sub(r"\.gguf$", "", base)
    slug = re.sub(r"[^a-z0-9]+", "-", base).strip("-")
    return f"llmctl-{slug}"[:_NAME_MAX].rstrip("-")


def default_model_path(model: str | None) -> str | None:
    """Where the model is in the pod: a local path stays where it is (the node holds it at the
    same path, as `cluster up` mounts it), a catalog name goes under /models; None: the image's
    bundled model."""
    if model is None:
        return None
    local = Path(model).expanduser()
    if local.exists():
        return str(local.resolve())
    return posixpath.join("/models", model)


KUBE_PANEL = "Kubernetes (--emit)"
_EMIT = dict(panel=KUBE_PANEL, commands=(PLAN,))


@dataclass(frozen=True)
class EmitFlags:
    """`llmctl plan --emit`'s options: what KubeOptions is made of, as the user gives it."""

    emit: str | None = option(
        "Write the plan as Kubernetes manifests: lws (a LeaderWorkerSet, mp backend across "
        "nodes), rayservice (KubeRay's RayService: llmctl's Ray Serve application, a replica per "
        "data-parallel replica; also: kuberay) or raycluster (KubeRay's RayCluster running "
        "llmctl serve, ray backend).",
        default=None,
        default_help="",
        **_EMIT,
    )
    output: str | None = option(
        "--emit: the YAML file.", default=None, aliases=("-o",), default_help="stdout", **_EMIT
    )
    image: str = option(
        "--emit: the container image.", default=DEFAULT_IMAGE, show_default=True, **_EMIT
    )
    name: str | None = option(
        "--emit: the objects' name.", default=None, default_help="llmctl-MODEL", **_EMIT
    )
    namespace: str | None = option("--emit: their namespace.", default=None, **_EMIT)
    port: int = option(
        "--emit: the serving port (and its probes').",
        default=DEFAULT_PORT,
        show_default=True,
        **_EMIT,
    )
    model_path: str | None = option(
        "--emit: the model's path in the pod.",
        default=None,
        default_help="a local MODEL's own path, else /models/MODEL",
        **_EMIT,
    )
    model_host_path: str | None = option(
        "--emit: the node's directory mounted at the model's directory.",
        default=None,
        default_help="the same path",
        **_EMIT,
    )
    model_pvc: str | None = option(
        "--emit: a PersistentVolumeClaim holding the model instead.", default=None, **_EMIT
    )
    shm_size: str = option(
        "--emit: the size of /dev/shm.", default=DEFAULT_SHM_SIZE, show_default=True, **_EMIT
    )
    socket_ifname: str = option(
        "--emit: NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME.",
        default=DEFAULT_SOCKET_IFNAME,
        show_default=True,
        **_EMIT,
    )
    master_port: int | None = option(
        "--emit lws: the rendezvous port of the leader.",
        default=None,
        default_help=str(DEFAULT_MASTER_PORT),
        **_EMIT,
    )
    ray_version: str | None = option(
        "--emit raycluster/rayservice: the image's Ray version, for KubeRay.",
        default=None,
        **_EMIT,
    )

    def kube_options(self, model: str | None) -> KubeOptions | None:
        """The KubeOptions to emit, None without --emit."""
        if self.emit is None:
            return None
        given = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("emit", "output")
        }
        return kube_options(self.emit, model, **given)


def kube_options(
    kind: str,
    model: str | None,
    *,
    name: str | None = None,
    model_path: str | None = None,
    model_host_path: str | None = None,
    model_pvc: str | None = None,
    **given: object,
) -> KubeOptions:
    """KubeOptions for MODEL (as `llmctl plan` got it), the flags not given defaulted: the name
    from the model's, the model's path in the pod, and the node's directory of the same path
    mounted there unless a PVC holds it."""
    from llmctl.engine.model_loader.default_model import DEFAULT_MODEL_NAME

    model_path = model_path or default_model_path(model)
    if model_path and not model_pvc and not model_host_path and posixpath.isabs(model_path):
        model_host_path = posixpath.dirname(model_path)
    given = {k: v for k, v in given.items() if v is not None}
    return KubeOptions(
        kind=kind,
        name=name or default_name(model or DEFAULT_MODEL_NAME),
        model_path=model_path,
        model_host_path=model_host_path,
        model_pvc=model_pvc,
        **given,
    )
