"""The startup budget: how long one engine replica may take from pod start to ready. One number, read by
the engine pod's startup probe and the Deployment's progress deadline (children/), the router's queue TTL
(how long the endpoint picker holds a request while a scaled-to-zero service wakes) and the autoscaler's
wake (plan/scale_to_zero.py)."""

import math

from tokenmill.operator.plan.sizing import SizingPlan
from tokenmill.operator.plan.spec import ServiceSpec

# A fixed part (CUDA init, GGUF conversion, CUDA-graph capture) plus reading the weights at a pessimistic
# 100 MB/s (network volumes); users can set engine.startupTimeoutSeconds.
STARTUP_BASE_SECONDS = 600
STARTUP_BYTES_PER_SECOND = 100e6
# hf:// models may be downloaded first (an empty cache): the whole checkpoint at a pessimistic 50 MB/s.
STARTUP_DOWNLOAD_BYTES_PER_SECOND = 50e6


def startup_timeout_seconds(spec: ServiceSpec, plan: SizingPlan) -> int:
    if spec.startup_timeout_seconds is not None:
        return spec.startup_timeout_seconds
    budget = STARTUP_BASE_SECONDS + math.ceil(plan.weights_bytes_per_gpu / STARTUP_BYTES_PER_SECOND)
    if spec.model_scheme == "hf":
        budget += math.ceil(plan.weights_bytes / STARTUP_DOWNLOAD_BYTES_PER_SECOND)
    return budget
