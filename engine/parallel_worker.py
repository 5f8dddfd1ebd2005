"""A worker rank of a tensor/pipeline-parallel replica, and the headless launcher of a worker node.

A rank joins the leader's group, receives the engine config from rank 0, loads its shard, sizes its
KV pool (the blocks every rank agrees on), then runs one forward per step message until rank 0 sends
the shutdown message. It never decides anything: the step's batch comes from rank 0 (step_input.py).
If the leader dies its connections close and the rank exits non-zero.

`tokenmill serve --headless` on node i of a multi-node replica (LeaderWorkerSet: LWS_WORKER_INDEX=i,
LWS_GROUP_SIZE=nodes, LWS_LEADER_ADDRESS=leader) starts that node's ranks with `run_headless` and
exits when they do (non-zero if any failed).
"""

import argparse
import logging
import os
import sys
import threading
import time

import torch
from tokenmill.engine import kv_memory
from tokenmill.engine.config import EngineConfig

logger = logging.getLogger("tokenmill.engine.parallel_worker")


PARENT_POLL_S = 0.5


def exit_with_parent() -> None:
    """A rank never outlives the process that started it (rank 0's engine core, or a headless node's
    launcher): when that one dies, even by SIGKILL, this one exits within PARENT_POLL_S. Without this a
    rank blocked in the rendezvous or in a wait for the next step would be left running."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        logger.error("the process that started this rank (pid %d) is gone; exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_rank(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from tokenmill.engine.engine_core import num_kv_blocks_for
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.engine.model_loader import load_model, resolve_dtype, resolve_model
    from tokenmill.engine.parallel_executor import agree_num_kv_blocks, make_runner
    from tokenmill.engine.parallel_state import init_parallel
    from tokenmill.engine.shm_broadcast import ShmRing
    from tokenmill.engine.step_input import receive_step

    device = torch.device(f"cuda:{args.local_rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t, p = args.tensor_parallel_size, args.pipeline_parallel_size
    shape = EngineConfig(
        tensor_parallel_size=t, pipeline_parallel_size=p, collective_timeout_s=args.collective_timeout,
        nnodes=args.nnodes,
    )  # fmt: skip
    par = init_parallel(shape, args.rank, args.master_addr, args.master_port, device)
    box = [None, None]
    dist.broadcast_object_list(box, src=0, group=par.control_group)
    config = EngineConfig(**box[0])
    if par.on_leader_node:  # rank 0's node: each step comes through its shared-memory ring
        path, max_step_bytes = box[1]
        par.step_ring = ShmRing.attach(path, par.ranks_per_node - 1, max_step_bytes, par.rank - 1)
    dist.barrier(group=par.control_group)  # rank 0 removes the ring's file once all mapped it
    if (config.tensor_parallel_size, config.pipeline_parallel_size) != (t, p):
        raise ValueError(
            f"rank {args.rank} was started for tensor_parallel_size={t} x pipeline_parallel_size={p}, but the "
            f"leader runs {config.tensor_parallel_size} x {config.pipeline_parallel_size}"
        )
    # The leader's resolved folder when this node has it (same node, shared volume); else this node's
    # own --model (a multi-node worker resolves or downloads it itself).
    leader_path = config.model and os.path.isdir(config.model)
    model_path = resolve_model(config.model if leader_path else args.model)
    mc = load_model_config(model_path)
    dtype = resolve_dtype(config.dtype, device.type)
    dtype_name = str(dtype).removeprefix("torch.")
    max_model_len = config.max_model_len or mc.max_model_len
    torch.manual_seed(config.seed)
    model = load_model(model_path, mc, dtype, device, par)
    kv_per_token = kv_memory.kv_bytes_per_token(
        mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, dtype_name, t, p
    )
    num_blocks = agree_num_kv_blocks(num_kv_blocks_for(config, device, kv_per_token), par)
    runner = make_runner(model, mc, config, num_blocks, max_model_len, dtype, device, par)
    logger.info("rank %d (tp %d, pp %d) ready: %d KV blocks on %s", par.rank, par.tp_rank, par.pp_rank,
                num_blocks, device)  # fmt: skip
    while True:  # rank 0 gone: exit_with_parent (its node) or a closed gloo connection (other nodes)
        step = receive_step(par)
        if step is None:
            break
        runner.forward(step)
    # No destroy_process_group: it can take seconds on a loaded machine and exiting closes everything.
    return 0


def run_headless(config: EngineConfig, node_rank: int, leader_addr: str, master_port: int) -> int:
    """Start this worker node's ranks and wait; the first one that fails takes the others down."""
    from tokenmill.engine.parallel_executor import spawn_local_ranks

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenmill-parallel-worker")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--local-rank", type=int, required=True)
    ap.add_argument("--tensor-parallel-size", type=int, required=True)
    ap.add_argument("--pipeline-parallel-size", type=int, required=True)
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], required=True)
    ap.add_argument("--collective-timeout", type=float, required=True)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--model", default=None, help="this node's model, when the leader's folder is not here")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("TOKENMILL_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s [rank {args.rank}] %(name)s: %(message)s",
    )
    exit_with_parent()
    try:
        return run_rank(args)
    except Exception as e:
        logger.error("rank %d failed: %s: %s", args.rank, type(e).__name__, e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
