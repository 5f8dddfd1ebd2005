"""Rank 0's side of tensor/pipeline parallelism: start this node's other ranks, join the group, watch them.
(executor.py builds on it; headless.py starts a worker node's ranks with spawn_local_ranks.)

The engine core process is rank 0: it keeps the scheduler and the sampler, runs its own shard, and
broadcasts each step (step_input.py). The other ranks of this node are `python -m
tokenmill.engine.worker.rank_main` processes; ranks on other nodes come from `tokenmill serve --headless`
there (docs/engine.md, "Multi-node launch"). A watchdog thread notices a local rank that exits, or a
rank on another node whose liveness connection closes (liveness.py), and takes the engine
down at once, naming the rank (and the other node's host).
"""

import _thread
import atexit
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.distributed import liveness
from tokenmill.engine.distributed.parallel_state import ParallelState, init_parallel
from tokenmill.engine.distributed.shm_broadcast import ShmRing
from tokenmill.engine.worker.step_input import broadcast_step

logger = logging.getLogger(__name__)

DEFAULT_DIST_PORT = 29500  # multi-node: the port workers dial on the leader (TOKENMILL_DIST_PORT)
WATCHDOG_POLL_S = 0.2
# After a rank died, the main thread gets an interrupt; if it sits in a C call that never returns
# (a collective), the process exits by itself after this long.
EXIT_GRACE_S = 3.0
SHUTDOWN_WAIT_S = 4.0  # below the API process's 5 s wait for the engine core (core/client.py)
PROC_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped", "t": "stopped",
               "Z": "exited"}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_command(
    config: EngineConfig, rank: int, local_rank: int, master_addr: str, master_port: int, device_type: str
) -> list[str]:
    """The command line of one local worker rank (the same one `tokenmill serve --headless` runs)."""
    return [
        sys.executable, "-m", "tokenmill.engine.worker.rank_main",
        "--rank", str(rank),
        "--local-rank", str(local_rank),
        "--tensor-parallel-size", str(config.tensor_parallel_size),
        "--pipeline-parallel-size", str(config.pipeline_parallel_size),
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        "--device", device_type,
        "--collective-timeout", str(config.collective_timeout_s),
        "--nnodes", str(config.nnodes),
        *(["--model", config.model] if config.model else []),
    ]  # fmt: skip


def spawn_local_ranks(
    config: EngineConfig, ranks: range, first_local: int, master_addr: str, master_port: int, device_type: str
) -> dict[int, subprocess.Popen]:
    """Start one worker process per rank. Their working directory is not the repository root: there,
    the repository's operator/ package would shadow the standard library's `operator` module."""
    procs = {}
    for i, rank in enumerate(ranks):
        cmd = worker_command(config, rank, first_local + i, master_addr, master_port, device_type)
        procs[rank] = subprocess.Popen(cmd, cwd="/")
        logger.info("started parallel rank %d (pid %d)", rank, procs[rank].pid)
    return procs


# How long a failed step's log waits for the local ranks to exit before it describes them: a rank killed
# by a signal closes its sockets before it becomes a zombie, so the leader's collective can fail while the
# rank still shows as running (seen in CI: test_parallel_serve's killed rank was logged "is running").
DEATH_GRACE_S = 1.0


def _exit_code(proc: subprocess.Popen, deadline: float) -> int | None:
    """The rank's exit code once it has exited, waiting until `deadline` (time.monotonic()); None if it
    still runs then. Popen.poll() would answer None, without reaping, while another thread (the watchdog)
    holds the Popen's wait lock; wait() with a timeout retries until it gets the lock."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


class RankWatchdog:
    """Polls local rank processes; the first that exits takes this process down, with its rank in the log."""

    def __init__(self, procs: dict[int, subprocess.Popen], on_death: str = "interrupt") -> None:
        self.procs = procs
        self.remote: dict[int, liveness.RemoteRank] = {}  # ranks on other nodes, once connected
        self.dead: str | None = None
        self._stop = threading.Event()
        self._dying = threading.Lock()
        self._on_death = on_death
        self._thread = threading.Thread(target=self._run, name="rank-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(WATCHDOG_POLL_S):
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    self._die(f"parallel rank {rank} (pid {proc.pid}) exited with code {code}")

    def _die(self, dead: str) -> None:
        """Log the dead rank, kill the local ones, take this process down (once, whoever calls)."""
        with self._dying:
            if self._stop.is_set():  # shutting down in order: ranks exit on purpose
                return
            self.dead = dead
            logger.error("%s; the engine cannot run without it and exits", dead)
            for other in self.procs.values():
                if other.poll() is None:
                    other.kill()
            if self._on_death == "exit":
                os._exit(1)
            _thread.interrupt_main()
            time.sleep(EXIT_GRACE_S)
            logger.error("%s; exiting", dead)
            os._exit(1)

    def watch_remote(self, server: socket.socket, expected: int) -> None:
        """Multi-node: accept the liveness connections of the `expected` ranks on other nodes
        (liveness.py) and take the engine down, naming the rank and its host, when one closes."""
        accept = threading.Thread(
            target=self._accept_remote, args=(server, expected), name="rank-accept", daemon=True
        )
        accept.start()

    def _accept_remote(self, server: socket.socket, expected: int) -> None:
        try:
            while len(self.remote) < expected:
                try:
                    remote = liveness.accept_one(server)
                except (ConnectionError, ValueError) as e:  # not one of our ranks: keep waiting for them
                    logger.warning("ignored a liveness connection: %s", e)
                    continue
                self.remote[remote.rank] = remote
                logger.info("%s connected", remote.describe())
                threading.Thread(target=self._watch_remote, args=(remote,), name=f"rank-{remote.rank}-watch",
                                 daemon=True).start()  # fmt: skip
        except OSError as e:
            if not self._stop.is_set():
                logger.warning("stopped accepting ranks' liveness connections: %s", e)
        finally:
            server.close()

    def _watch_remote(self, remote: liveness.RemoteRank) -> None:
        try:
            remote.conn.recv(1)  # a rank never sends after its introduction: this returns when it is gone
        except OSError:
            pass
        self._die(f"{remote.describe()} closed its connection to the leader (its process or node is gone)")

    def stop(self) -> None:
        self._stop.set()

    def describe_ranks(self) -> str:
        """Each local rank's process state, for the log line of a step whose collective failed: a dead
        rank (or one that exits within DEATH_GRACE_S) with its exit code, a hung one as "stopped"
        (SIGSTOP) or "running"/"sleeping" (stuck)."""
        parts = []
        deadline = time.monotonic() + DEATH_GRACE_S
        for rank, proc in self.procs.items():
            code = _exit_code(proc, deadline)
            if code is not None:
                parts.append(f"parallel rank {rank} (pid {proc.pid}) exited with code {code}")
                continue
            try:
                with open(f"/proc/{proc.pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "?"
            parts.append(f"parallel rank {rank} (pid {proc.pid}) is {PROC_STATES.get(state, state)}")
        for _, remote in sorted(self.remote.items()):
            closed = liveness.is_closed(remote.conn)
            parts.append(f"{remote.describe()} {'closed its connection' if closed else 'is connected'}")
        return "; ".join(parts) or "no ranks to describe"


@dataclasses.dataclass(slots=True)
class LeaderGroup:
    """Rank 0's handle on the group: shut it down in order once."""

    par: ParallelState
    procs: dict[int, subprocess.Popen]
    watchdog: RankWatchdog
    closed: bool = False
    failed: bool = False  # a step failed: do not wait for ranks that may hang

    def step_failed(self, err: BaseException, collective_timeout_s: float) -> None:
        """Log which rank took the step down: a collective failed at once (a peer closed its
        connections) or after collective_timeout_s (a peer hung)."""
        logger.error(
            "a parallel step failed (%s: %s; collectives wait at most %.0f s); %s",
            type(err).__name__, err, collective_timeout_s, self.watchdog.describe_ranks(),
        )  # fmt: skip
        self.failed = True

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.watchdog.stop()  # from here on, ranks that exit do so on purpose
        try:
            if not self.failed:  # after a failed step a rank may hang: it is killed below instead
                broadcast_step(None, self.par)
        except Exception as e:  # a rank is already gone; the others exit on their own
            logger.warning("could not tell the parallel ranks to stop: %s", e)
        deadline = time.monotonic() + (0.0 if self.failed else SHUTDOWN_WAIT_S)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        if not self.failed:  # after a failure the group may be half gone; the process exits anyway
            dist.destroy_process_group()


def start_leader(config: EngineConfig, device: torch.device, max_step_bytes: int) -> LeaderGroup:
    """Start this node's worker ranks, join the group as rank 0, send every rank the config and the
    shared-memory ring (of max_step_bytes per message) its node's ranks read each step from."""
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    per_node = world // config.nnodes
    if config.nnodes > 1:
        port = config.dist_port or DEFAULT_DIST_PORT
        master_addr = "0.0.0.0"
    else:
        port = config.dist_port or free_port()
        master_addr = "127.0.0.1"
    procs = spawn_local_ranks(config, range(1, per_node), 1, "127.0.0.1", port, device.type)
    watchdog = RankWatchdog(procs)
    try:
        par = init_parallel(config, 0, master_addr, port, device)
        ring = ShmRing.create(per_node - 1, max_step_bytes) if per_node > 1 else None
        try:
            ring_info = (ring.path, max_step_bytes) if ring else None
            dist.broadcast_object_list(
                [dataclasses.asdict(config), ring_info], src=0, group=par.control_group
            )
            dist.barrier(group=par.control_group)  # every local rank has mapped the ring
        finally:
            if ring is not None:
                ring.unlink()
        par.step_ring = ring
        if par.liveness is not None:  # multi-node: the ranks of the other nodes
            watchdog.watch_remote(par.liveness, world - per_node)
    except BaseException:
        watchdog.stop()
        for proc in procs.values():
            proc.kill()
        raise
    group = LeaderGroup(par, procs, watchdog)
    atexit.register(group.shutdown)
    logger.info(
        "parallel group up: tensor_parallel_size=%d x pipeline_parallel_size=%d = %d ranks over %d node(s)",
        config.tensor_parallel_size, config.pipeline_parallel_size, world, config.nnodes,
    )  # fmt: skip
    return group
