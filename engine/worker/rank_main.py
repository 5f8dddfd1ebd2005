"""The process of a worker rank of a tensor/pipeline-parallel replica (`python -m
tokenmill.engine.worker.rank_main`, started by rank 0's executor or a headless node's launcher).

A rank joins the leader's group, receives the engine config from rank 0, builds its Worker as rank 0 does
(plan, weights of its shard, the KV pool every rank agrees on), then runs one forward per step message
until rank 0 sends the shutdown message. It never decides anything: the step's batch comes from rank 0
(step_input.py). If the leader dies its connections close and the rank exits non-zero.
"""

import argparse
import dataclasses
import logging
import os
import sys
import threading
import time

import torch
from tokenmill.engine.config import EngineConfig

logger = logging.getLogger("tokenmill.engine.worker.rank_main")


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
    from tokenmill.engine.distributed.parallel_state import init_parallel
    from tokenmill.engine.distributed.shm_broadcast import ShmRing
    from tokenmill.engine.worker.engine_plan import plan_engine
    from tokenmill.engine.worker.step_input import receive_step
    from tokenmill.engine.worker.worker import Worker

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
    plan = plan_engine(dataclasses.replace(config, model=config.model if leader_path else args.model))
    worker = Worker(plan, device, par)  # as rank 0's executor builds its own
    worker.load_model()
    worker.initialize_cache(worker.determine_num_kv_blocks())
    while True:  # rank 0 gone: exit_with_parent (its node) or a closed gloo connection (other nodes)
        step = receive_step(par)
        if step is None:
            break
        worker.forward(step)
    # No destroy_process_group: it can take seconds on a loaded machine and exiting closes everything.
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
    code = main()
    # Leave without C++ static destructors: gloo's process group still owns threads (no
    # destroy_process_group, above), and destroying a joinable std::thread at exit aborts the process
    # ("terminate called without an active exception", exit -6: seen once in CI after a clean stop).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
