"""A liveness connection from every rank on another node to rank 0, so the leader can name a dead one.

Rank 0 cannot poll the processes of other nodes (parallel_executor.RankWatchdog polls its own). On a
multi-node replica each rank on another node opens one TCP connection to rank 0 after the rendezvous
and says who it is ("rank host pid"); it never sends anything else. When that process dies, however it
dies (SIGKILL included), its kernel closes the connection and rank 0 sees end-of-file at once; when the
whole node goes away, TCP keepalive probes (KEEPALIVE_IDLE_S + KEEPALIVE_COUNT x KEEPALIVE_INTERVAL_S)
end the connection. Rank 0's port is ephemeral and published through the rendezvous store.
"""

import os
import socket
from dataclasses import dataclass

STORE_KEY = "tokenmill/liveness_port"
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 3
HELLO_MAX_BYTES = 512


@dataclass(slots=True)
class RemoteRank:
    rank: int
    host: str  # the name the rank's node gave itself
    addr: str  # the address its connection came from
    pid: int
    conn: socket.socket

    def describe(self) -> str:
        return f"parallel rank {self.rank} on host {self.host} ({self.addr}, pid {self.pid})"


def listen(store: object) -> socket.socket:
    """Rank 0: a listening socket on every interface, its port published in the store."""
    server = socket.create_server(("", 0), backlog=64)
    store.set(STORE_KEY, str(server.getsockname()[1]))
    return server


def connect(store: object, master_addr: str, rank: int, timeout_s: float) -> socket.socket:
    """A rank on another node: connect to rank 0 and introduce itself; keep the socket open for life."""
    port = int(store.get(STORE_KEY))
    try:
        conn = socket.create_connection((master_addr, port), timeout=timeout_s)
    except OSError as e:  # e.g. a network policy that lets through only the rendezvous port
        raise ConnectionError(
            f"rank {rank} could not open its liveness connection to the leader at {master_addr}:{port} "
            f"(an ephemeral port, like gloo's own connections; it must be reachable from this node): {e}"
        ) from e
    conn.settimeout(None)
    conn.sendall(f"{rank} {socket.gethostname()} {os.getpid()}\n".encode())
    return conn


def keepalive(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)


def accept_one(server: socket.socket) -> RemoteRank:
    """Rank 0: the next rank's connection and its introduction."""
    conn, (addr, *_) = server.accept()
    keepalive(conn)
    hello = b""
    while not hello.endswith(b"\n"):
        chunk = conn.recv(HELLO_MAX_BYTES)
        if not chunk or len(hello) > HELLO_MAX_BYTES:
            conn.close()
            raise ConnectionError(f"a rank connected from {addr} but did not introduce itself")
        hello += chunk
    try:
        rank, host, pid = hello.decode().split()
        return RemoteRank(int(rank), host, addr, int(pid), conn)
    except ValueError as e:
        conn.close()
        raise ValueError(f"a connection from {addr} sent {hello[:80]!r}, not 'rank host pid'") from e


def is_closed(conn: socket.socket) -> bool:
    """Without blocking: has the other side closed (or reset) the connection?"""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
