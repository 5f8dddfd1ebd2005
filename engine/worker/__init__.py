"""One rank: its device and dtype, kernels, weights, KV pool, ModelRunner, sampler and CUDA graphs.

`Worker` is what every rank builds, rank 0 (inside the engine core, through the executor) and every other
rank (`rank_main.py`, its own process) the same way. May import model/, models/, layers/, distributed/,
tokenmill.kernels and the top-level leaves; never executor/ or core/.
"""
