"""The ranks that run the model, as the engine core sees them: rank 0's Worker in the core's process and,
with tensor/pipeline parallelism, the other ranks (processes on this node, `serve --headless` nodes),
started, watched and stopped here.

Runs in the engine core process (and `headless.py` in a worker node's launcher). May import worker/,
distributed/, model/ and the top-level leaves; never core/.
"""
