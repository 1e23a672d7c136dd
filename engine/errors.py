"""Typed errors: one class per failure kind, each with a message and a hint naming what to change.

The CLI prints `message` on one line and `hint` below it; `--debug` adds the traceback. The classes
that describe bad input also derive from ValueError, so code written for vLLM that catches
ValueError keeps working.
"""

from __future__ import annotations


class LLMCtlError(Exception):
    """Base class of every error llmctl raises on purpose."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}. Hint: {hint}")

    def __reduce__(self):
        # Errors cross process boundaries (worker processes, Ray actors) with their fields.
        return (_rebuild, (type(self), self.message, self.hint, dict(self.__dict__)))


def _rebuild(cls: type, message: str, hint: str | None, state: dict) -> LLMCtlError:
    error = cls.__new__(cls)
    LLMCtlError.__init__(error, message, hint)
    error.__dict__.update(state)
    return error


class ConfigError(LLMCtlError, ValueError):
    """An engine or cluster setting has an impossible value."""


class ModelNotFoundError(LLMCtlError, FileNotFoundError):
    """The model path does not exist, or the bundled default model is not installed."""


class ModelLoadError(LLMCtlError):
    """The model exists but cannot be read: corrupt or incomplete weights or config."""


class UnsupportedArchitectureError(LLMCtlError, ValueError):
    """The config's `architectures` names a model the registry does not implement."""


class InvalidRequestError(LLMCtlError, ValueError):
    """One request is invalid (prompt or sampling parameters); other requests are unaffected."""

    def __init__(self, message: str, hint: str | None = None, param: str | None = None) -> None:
        super().__init__(message, hint)
        self.param = param  # the request field at fault, as the OpenAI API names it


class InvalidSamplingParamsError(InvalidRequestError):
    """A SamplingParams field is out of range."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus one generated token) does not fit in max_model_len."""


class KVCacheTooSmallError(ConfigError):
    """The KV cache cannot hold even one request of max_model_len tokens."""


class DeviceMemoryError(ConfigError):
    """The GPU's memory cannot hold the weights, the profile run's activations, or any KV cache
    after them: the message gives the sizes, the hint the knobs (more GPUs, -tp/-pp, ...)."""


class RequestBatchError(InvalidRequestError):
    """Some prompts of a batch were invalid; the valid ones still ran.

    `errors` maps the index of each rejected prompt to its error; `outputs` holds the finished
    RequestOutputs of the others (None where a prompt was rejected), so nothing is lost.
    """

    def __init__(self, errors: dict[int, InvalidRequestError], outputs: list) -> None:
        self.errors = errors
        self.outputs = outputs
        first_index, first = next(iter(errors.items()))
        count = len(errors)
        message = (
            f"{count} of {len(outputs)} prompts rejected; the prompt at index {first_index} "
            f"(counting from 0): {first.message}"
        )
        super().__init__(message, first.hint, first.param)


class EngineDeadError(LLMCtlError, RuntimeError):
    """A worker process died or the engine loop stopped; in-flight requests cannot finish."""


class WorkerError(EngineDeadError):
    """One worker rank died or raised; the executor stopped every worker. `rank` names it and
    `reason` says what happened ("was killed by SIGKILL", "raised RuntimeError: ...")."""

    def __init__(
        self, message: str, hint: str | None = None, *, rank: int = -1, reason: str = ""
    ) -> None:
        super().__init__(message, hint)
        self.rank = rank
        self.reason = reason


class WorkerTimeoutError(EngineDeadError):
    """Workers did not answer within the time a caller gave; the executor stopped every worker.
    `pending_ranks` are the ranks that had not answered."""

    def __init__(
        self, message: str, hint: str | None = None, *, pending_ranks: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message, hint)
        self.pending_ranks = pending_ranks


class EngineStalledError(EngineDeadError):
    """The engine had work and no step completed for --stall-timeout seconds: the workers were
    stopped. `ranks` names the ranks that had not answered and `stopped` the stopped workers'
    ranks (a SIGSTOPped process), where the executor knows them."""

    def __init__(
        self,
        message: str,
        hint: str | None = None,
        *,
        ranks: tuple[int, ...] = (),
        stopped: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message, hint)
        self.ranks = ranks
        self.stopped = stopped


class EngineRestartingError(EngineDeadError):
    """The engine failed and is being started again (--restart-on-failure): retry shortly."""


class UnsupportedQuantizationError(LLMCtlError, ValueError):
    """The checkpoint's quantization (a GGUF tensor type) is one llmctl cannot run."""


class RendezvousError(LLMCtlError, RuntimeError):
    """The nodes of an mp group (--nnodes) could not form it: an address or port node 0 cannot
    use, a master a node cannot reach, a node refused (its rank taken, its layout different).
    Nothing is left running on the node that raises it."""


class ClusterSecretError(RendezvousError):
    """A join between nodes failed on the cluster secret (engine/distributed/join.py): the other
    side holds another secret or none, could not prove it holds ours, or replayed a handshake.
    Nothing sent by a peer that failed is parsed or unpickled."""


class RendezvousTimeoutError(RendezvousError):
    """Nodes did not join within --rendezvous-timeout. `missing_node_ranks` are the nodes that
    did not, `missing_ranks` their global ranks."""

    def __init__(
        self,
        message: str,
        hint: str | None = None,
        *,
        missing_node_ranks: tuple[int, ...] = (),
        missing_ranks: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message, hint)
        self.missing_node_ranks = missing_node_ranks
        self.missing_ranks = missing_ranks


class DataParallelJoinError(RendezvousError):
    """Data-parallel replicas on several nodes could not join the head's router: the head
    unreachable (its address named), a replica rank given twice, nodes started with different
    sizes or models. Nothing is left running on the node that raises it."""


class DataParallelJoinTimeoutError(DataParallelJoinError):
    """Replicas did not join the head within --rendezvous-timeout; `missing_replicas` are their
    data-parallel ranks."""

    def __init__(
        self, message: str, hint: str | None = None, *, missing_replicas: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message, hint)
        self.missing_replicas = missing_replicas
