"""Typed errors of planning and cluster operations (LLMCtlError: a message and a hint)."""

from __future__ import annotations

from llmctl.engine.errors import ConfigError, LLMCtlError


class InventoryError(ConfigError):
    """The inventory file (or the flags standing for it) is malformed or impossible."""


class PlanError(LLMCtlError):
    """No layout of this inventory holds the model; the message says how much memory is missing."""


class UnknownModelError(ConfigError):
    """The model is neither a local directory or GGUF file, nor in the catalog."""


class ClusterError(LLMCtlError):
    """A cluster operation failed on a node; the message names the node and the cause."""


class HostUnreachableError(ClusterError):
    """SSH cannot connect to the node (no route, refused, timed out, unknown name)."""


class SSHAuthError(ClusterError):
    """The node rejects the SSH key or user, or its host key changed."""


class RemoteCommandError(ClusterError):
    """A command on a node exited non-zero where success was required."""


class DockerUnavailableError(ClusterError):
    """Docker is not installed on the node, or its daemon does not answer."""


class ImageMissingError(ClusterError):
    """The container image is not on the node (and no --image-file was given to load it)."""


class ModelMismatchError(ClusterError):
    """The model path is missing on a node, or its content differs from the head's."""


class NodeNetworkError(ClusterError):
    """A node's IP is not its own, not on the head's network, or public without consent."""


class RayClusterError(ClusterError):
    """Ray did not form the cluster the inventory declares (nodes, GPUs, node IPs)."""


class ImageBuildError(ClusterError):
    """`llmctl image build` could not build the image."""


class CollectiveError(ClusterError):
    """The all-reduce check failed: a rank hung, died or raised; the message names the rank."""


class CollectiveTimeoutError(CollectiveError):
    """A rank did not finish the all-reduce check within the timeout."""
