"""`tokenmill serve --headless` on node i of a multi-node replica (LeaderWorkerSet: LWS_WORKER_INDEX=i,
LWS_GROUP_SIZE=nodes, LWS_LEADER_ADDRESS=leader): start that node's ranks and exit when they do (non-zero
if any failed; the first that fails takes the others down). No HTTP, no scheduler: the leader's engine
core drives every rank."""

import logging
import time

import torch
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.executor.multiproc import spawn_local_ranks

logger = logging.getLogger("tokenmill.engine.executor.headless")


def run_headless(config: EngineConfig, node_rank: int, leader_addr: str, master_port: int) -> int:
    """Start this worker node's ranks and wait; the first one that fails takes the others down."""
    device_type = "cuda" if config.device != "cpu" and torch.cuda.is_available() else "cpu"
    per_node = config.tensor_parallel_size * config.pipeline_parallel_size // config.nnodes
    ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
    logger.info("headless worker node %d: ranks %d-%d, leader %s:%d", node_rank, ranks.start, ranks.stop - 1,
                leader_addr, master_port)  # fmt: skip
    procs = spawn_local_ranks(config, ranks, 0, leader_addr, master_port, device_type)
    while procs:
        for rank, proc in list(procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del procs[rank]
            if code != 0:
                logger.error("parallel rank %d (pid %d) exited with code %d; stopping this node", rank,
                             proc.pid, code)  # fmt: skip
                for other in procs.values():
                    other.kill()
                return 1
        time.sleep(0.2)
    return 0
