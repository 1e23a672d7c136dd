"""The join protocol: how a node connects to another node's listener, proves that it holds the
cluster secret, and is accepted or refused, before anything it sends is parsed or unpickled.

Every listener between nodes speaks it: node 0's rendezvous of an mp group (--nnodes: each node's
control connection and its per-rank connections, engine/distributed/rendezvous.py) and the
data-parallel head's join server (engine/dp/join_server.py). Both sides hold the cluster secret
(LLMCTL_CLUSTER_SECRET, or --cluster-secret-file PATH: the same on every node) and prove it to
each other with HMAC-SHA256 over two fresh random nonces, one from each side (the standard
library's hmac and secrets). A recorded exchange is worth nothing on another connection (the
other side's nonce differs), and neither side's proof can be reflected back as the other's (each
names its role). Only then is the hello read, and only once it is accepted are pickled
multiprocessing Connection frames exchanged:

    listener -> peer    b"LLMCTL-JOIN" VERSION (1 byte) MODE (1) NONCE_L (32)       45 bytes
    peer -> listener    MODE (1) NONCE_P (32) PROOF_P (32)                          65 bytes
    listener -> peer    STATUS (1) PROOF_L (32)                                     33 bytes
    peer -> listener    the hello: one JSON object on one line
    listener -> peer    {"ok": true, ...}  |  {"ok": false, "error": MSG, "hint": HINT}
    then multiprocessing Connection frames (4-byte length, pickle), the caller's protocol

    MODE     b"S": holds a secret; b"I": none (--insecure-join: nonces and proofs are zeros)
    PROOF_P  HMAC-SHA256(secret, b"llmctl-join peer" + NONCE_L + NONCE_P)
    PROOF_L  HMAC-SHA256(secret, b"llmctl-join listener" + NONCE_L + NONCE_P)
    STATUS   b"+": accepted, PROOF_L follows; refused (zeros follow): b"S" a wrong proof (another
             secret), b"R" a replayed handshake (a NONCE_P the listener has seen), b"N" the peer
             has no secret, b"I" the listener has none

The listener reads fixed-size fields only until the peer's proof checks out; the peer checks
PROOF_L before it sends its hello, so a fake listener learns nothing and nothing it sends is
read. A node with a secret never talks to one without. A peer that fails is dropped with one log
line naming its address, and the listener keeps why (`refused`), for the error that names the
nodes that never joined.

The frames after the handshake are neither encrypted nor signed: the secret keeps strangers from
joining a cluster or posing as one of its nodes, not an attacker who can rewrite packets on the
path (run the cluster on a network you trust, or under WireGuard or IPsec).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llmctl.engine import envs
from llmctl.engine.errors import ClusterSecretError, ConfigError

logger = logging.getLogger("llmctl")

SECRET_ENV = "LLMCTL_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16
HELLO_TIMEOUT_S = 10.0
MAGIC = b"LLMCTL-JOIN"
VERSION = 1
NONCE_BYTES = 32
_DIGEST_BYTES = 32  # SHA-256
_GREETING = len(MAGIC) + 2 + NONCE_BYTES
_ANSWER = 1 + NONCE_BYTES + _DIGEST_BYTES
_VERDICT = 1 + _DIGEST_BYTES
_PEER, _LISTENER = b"llmctl-join peer", b"llmctl-join listener"
_SEEN_NONCES = 65536  # the peers' nonces a listener remembers, to name a replay
_MAX_LINE = 16 * 1024
_RETRY_S = 0.5

SECRET_HINT = (
    "make one secret for the cluster and give it to every node: `python3 -c 'import secrets; "
    "print(secrets.token_hex(32))' > cluster.secret && chmod 600 cluster.secret`, then "
    "--cluster-secret-file cluster.secret (or LLMCTL_CLUSTER_SECRET set to it) on every node; "
    "`llmctl cluster up` makes one for its nodes. --insecure-join goes without one: then anyone "
    "who reaches the port can run code on every node"
)
SAME_SECRET_HINT = (
    "give every node the same LLMCTL_CLUSTER_SECRET or --cluster-secret-file (`llmctl cluster "
    "up` hands one to each of its nodes)"
)


def make_secret() -> str:
    """A new cluster secret: 256 random bits, as hex."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class ClusterSecret:
    """The secret every node of a cluster holds (`key`), or none: --insecure-join."""

    key: bytes | None = field(repr=False)
    source: str  # where it came from, for messages: the variable, the file, or --insecure-join

    @classmethod
    def load(
        cls, secret_file: str | None = None, insecure: bool = False, *, needed_by: str = ""
    ) -> ClusterSecret:
        """--cluster-secret-file, else LLMCTL_CLUSTER_SECRET; ConfigError (naming `needed_by`,
        what joins nodes) when neither is set, unless `insecure`."""
        if insecure:
            if secret_file:
                raise ConfigError(
                    "--insecure-join and --cluster-secret-file contradict each other",
                    "drop --insecure-join (every node then proves it holds the secret)",
                )
            return cls(None, "--insecure-join")
        if secret_file:
            value, source = _read_secret_file(secret_file), f"--cluster-secret-file {secret_file}"
        else:
            value, source = (envs.LLMCTL_CLUSTER_SECRET or "").strip(), SECRET_ENV
        if not value:
            raise ConfigError(
                f"{needed_by or 'this node'} joins nodes over the network, and no cluster secret "
                f"is set ({SECRET_ENV} or --cluster-secret-file): without one, anyone who reaches "
                "the port could run code on the nodes",
                SECRET_HINT,
            )
        if len(value) < MIN_SECRET_CHARS:
            raise ConfigError(
                f"the cluster secret ({source}) has {len(value)} characters; use at least "
                f"{MIN_SECRET_CHARS}",
                SECRET_HINT,
            )
        return cls(value.encode(), source)

    @property
    def insecure(self) -> bool:
        return self.key is None

    def __reduce__(self):
        raise TypeError("a cluster secret is not pickled: each node reads its own")


def _read_secret_file(path: str) -> str:
    try:
        file = Path(path).expanduser()
        value = file.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"--cluster-secret-file {path} cannot be read: {exc.strerror or exc}",
            "give the path of a file holding the cluster secret (the same on every node)",
        ) from None
    if file.stat().st_mode & 0o077:
        logger.warning(
            "--cluster-secret-file %s is readable by other users: chmod 600 %s", path, path
        )
    return value


def _proof(key: bytes, role: bytes, nonce_l: bytes, nonce_p: bytes) -> bytes:
    return hmac.new(key, role + nonce_l + nonce_p, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


def send_line(sock: socket.socket, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def recv_line(sock: socket.socket, timeout: float) -> dict:
    """One JSON line, byte by byte: what follows it (pickled frames) stays in the socket."""
    sock.settimeout(timeout)
    data = bytearray()
    while not data.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            raise ConnectionError("the peer closed the connection")
        data += byte
        if len(data) > _MAX_LINE:
            raise ConnectionError("the handshake line is too long")
    sock.settimeout(None)
    value = json.loads(data)
    if not isinstance(value, dict):
        raise ConnectionError("the handshake is not a JSON object")
    return value


def tune(sock: socket.socket) -> None:
    """Blocking, no Nagle delay, and keep-alive probes: a peer host that vanishes (no FIN) is
    noticed within about 25 s instead of never."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def accept(sock: socket.socket, **reply) -> None:
    """The listener's answer to an accepted hello (then the caller's frames)."""
    send_line(sock, {"ok": True, **reply})
    tune(sock)


def refuse(sock: socket.socket, message: str, hint: str | None, what: str = "a node") -> None:
    """The listener's answer to a hello it refuses; the connection ends."""
    logger.warning("Refused %s: %s", what, message)
    try:
        send_line(sock, {"ok": False, "error": message, "hint": hint})
    except OSError:
        pass
    sock.close()


# -- the listener ------------------------------------------------------------------------------


class JoinListener:
    """Accepts peers on a listening socket until close(): each is authenticated in a thread of
    its own (a silent peer holds up no one), then its hello is handed to `on_hello(sock, hello,
    peer)`, which answers with accept() or refuse(). Exceptions of a broken peer (OSError,
    ValueError, KeyError, TypeError) drop it."""

    def __init__(
        self,
        sock: socket.socket,
        secret: ClusterSecret,
        on_hello: Callable[[socket.socket, dict, str], None],
        name: str,
    ) -> None:
        self.secret = secret
        self.refused: dict[str, str] = {}  # peer address -> why its last try was refused
        self._sock = sock
        self._on_hello = on_hello
        self._name = name
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        if secret.insecure:
            logger.warning(
                "--insecure-join: joins at %s are not authenticated; anyone who reaches it can "
                "run code on this node",
                _address(sock.getsockname()),
            )
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept()
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=HELLO_TIMEOUT_S)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(sock, _address(peer)), name=self._name, daemon=True
            ).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.settimeout(HELLO_TIMEOUT_S)
            why = self._authenticate(sock)
            if why is not None:
                self.refused[peer.rsplit(":", 1)[0]] = why
                logger.warning("Refused a connection from %s: %s", peer, why)
                sock.close()
                return
            hello = recv_line(sock, HELLO_TIMEOUT_S)
            self._on_hello(sock, hello, peer)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("Dropped a connection from %s: %s", peer, exc or type(exc).__name__)
            sock.close()

    def _authenticate(self, sock: socket.socket) -> str | None:
        """None once the peer proved it holds the secret (or neither side has one); else why
        it is refused. Reads fixed-size fields only."""
        key = self.secret.key
        nonce_l = secrets.token_bytes(NONCE_BYTES) if key else bytes(NONCE_BYTES)
        sock.sendall(MAGIC + bytes([VERSION]) + (b"I" if key is None else b"S") + nonce_l)
        try:
            answer = recv_exact(sock, _ANSWER)
        except ConnectionError:
            return "it closed the connection before proving that it holds the cluster secret"
        mode, nonce_p, proof_p = answer[:1], answer[1 : 1 + NONCE_BYTES], answer[1 + NONCE_BYTES :]
        if key is None:
            if mode != b"I":
                return self._verdict(sock, b"I", "it holds a cluster secret; this node has none")
            sock.sendall(b"+" + bytes(_DIGEST_BYTES))
            return None
        if mode != b"S":
            return self._verdict(
                sock, b"N", "it offers no cluster secret (--insecure-join, or no llmctl node)"
            )
        with self._lock:
            replayed = nonce_p in self._seen
            self._seen[nonce_p] = None
            while len(self._seen) > _SEEN_NONCES:
                self._seen.popitem(last=False)
        if replayed:
            return self._verdict(sock, b"R", "it replayed an earlier handshake")
        if not hmac.compare_digest(proof_p, _proof(key, _PEER, nonce_l, nonce_p)):
            return self._verdict(
                sock, b"S", "its proof of the cluster secret is wrong (another secret, or no node)"
            )
        sock.sendall(b"+" + _proof(key, _LISTENER, nonce_l, nonce_p))
        return None

    @staticmethod
    def _verdict(sock: socket.socket, status: bytes, why: str) -> str:
        try:
            sock.sendall(status + bytes(_DIGEST_BYTES))
        except OSError:
            pass
        return why


def _address(sockaddr) -> str:
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- the peer ----------------------------------------------------------------------------------


class JoinTimeoutError(TimeoutError):
    """The listener did not answer before the deadline; `last` says what the last try met."""

    def __init__(self, last: str) -> None:
        super().__init__(last)
        self.last = last


def dial(
    host: str, port: int, secret: ClusterSecret, hello: dict, deadline: float, listener: str
) -> tuple[socket.socket, dict]:
    """Connect to the join listener at host:port, retrying until `deadline` (it may start
    later); prove the secret both ways, send `hello`, and return the socket with the listener's
    answer (the caller checks "ok"). Raises socket.gaierror when `host` does not resolve,
    JoinTimeoutError past the deadline, ClusterSecretError (naming `listener`) at once when the
    secrets disagree: trying again would not help."""
    last = "nothing answered"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise JoinTimeoutError(last)
        try:
            sock = socket.create_connection((host, port), timeout=min(5.0, remaining))
        except socket.gaierror:
            raise
        except OSError as exc:
            last = exc.strerror or str(exc) or type(exc).__name__
            time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))
            continue
        try:
            _prove(sock, secret, listener)
            send_line(sock, hello)
            reply = recv_line(sock, HELLO_TIMEOUT_S)
        except ClusterSecretError:
            sock.close()
            raise
        except (OSError, ValueError) as exc:
            sock.close()
            last = f"the handshake failed: {exc}"
            time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))
            continue
        tune(sock)
        return sock, reply


def _prove(sock: socket.socket, secret: ClusterSecret, listener: str) -> None:
    """The peer's side of the exchange; returns once the listener proved it holds the secret."""
    sock.settimeout(HELLO_TIMEOUT_S)
    greeting = recv_exact(sock, _GREETING)
    if greeting[: len(MAGIC)] != MAGIC or greeting[len(MAGIC)] != VERSION:
        raise ConnectionError(f"{listener} does not speak llmctl's join protocol {VERSION}")
    mode, nonce_l = greeting[len(MAGIC) + 1 : len(MAGIC) + 2], greeting[len(MAGIC) + 2 :]
    key = secret.key
    if key is not None and mode != b"S":
        raise ClusterSecretError(
            f"{listener} runs without a cluster secret (--insecure-join), and this node holds "
            f"one ({secret.source}): it does not join an unauthenticated group",
            "give every node the same cluster secret, or --insecure-join to every node",
        )
    nonce_p = secrets.token_bytes(NONCE_BYTES) if key else bytes(NONCE_BYTES)
    proof_p = _proof(key, _PEER, nonce_l, nonce_p) if key else bytes(_DIGEST_BYTES)
    sock.sendall((b"I" if key is None else b"S") + nonce_p + proof_p)
    verdict = recv_exact(sock, _VERDICT)
    status, proof_l = verdict[:1], verdict[1:]
    if status != b"+":
        raise _refusal(status, listener, secret)
    if key is not None and not hmac.compare_digest(
        proof_l, _proof(key, _LISTENER, nonce_l, nonce_p)
    ):
        raise ClusterSecretError(
            f"{listener} could not prove that it holds the cluster secret ({secret.source}): "
            "it is not the node it claims to be; nothing it sent was read",
            f"check that the address is the right node's; {SAME_SECRET_HINT}",
        )


def _refusal(status: bytes, listener: str, secret: ClusterSecret) -> ClusterSecretError:
    if status == b"S":
        return ClusterSecretError(
            f"{listener} refused this node's cluster secret ({secret.source}): the nodes hold "
            "different secrets",
            SAME_SECRET_HINT,
        )
    if status == b"R":
        return ClusterSecretError(
            f"{listener} refused the handshake as a replay of an earlier one", SAME_SECRET_HINT
        )
    if status == b"N":
        return ClusterSecretError(
            f"{listener} requires a cluster secret, and this node has none (--insecure-join)",
            SECRET_HINT,
        )
    return ClusterSecretError(
        f"{listener} refused this node: it runs without a cluster secret (--insecure-join)",
        "give every node the same cluster secret, or --insecure-join to every node",
    )
