"""The endpoint picker's EndpointPickerConfig (inference.networking.x-k8s.io/v1alpha1): which scorers
choose a pod for each request and how much each counts, and flow control (requests held while no pod
can take them). docs/operator.md, "Routing", explains the choice.

Scores are in [0, 1] per pod; the picker takes the pod with the highest weighted sum:
- prefix-cache-scorer, weight 3: the fraction of the prompt's blocks the pod already holds (from the
  picker's own index of what it sent where). A multi-turn chat resends the whole conversation; on the pod
  that served the last turn it is a prefix-cache hit, anywhere else a full prefill. Highest weight: a
  hit saves the most work, and it is what round robin loses.
- queue-scorer, weight 2: fewer waiting requests (vllm:num_requests_waiting), so a busy pod loses to an
  idle one unless the idle one has nothing of the prompt.
- kv-cache-utilization-scorer, weight 2: more free KV blocks (vllm:kv_cache_usage_perc): a pod near full
  would preempt.
- lora-affinity-scorer, weight 1, only when the service serves LoRA adapters: a pod that has the adapter
  loaded (vllm:lora_requests_info).
These are the upstream defaults (prefix 3, queue 2, KV 2) that llm-d's inference scheduling also starts
from: with 3 against 2 + 2, a full prefix match (3) outweighs a moderately busier pod but not a pod that
is both queued and nearly full (4), which avoids piling every turn of a popular prefix onto one pod.
"""

from tokenmill.operator.plan.sizing import SizingPlan

CONFIG_API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
WEIGHTS = {"prefix-cache-scorer": 3.0, "queue-scorer": 2.0, "kv-cache-utilization-scorer": 2.0}
LORA_WEIGHT = 1.0
PREFIX_PRODUCER = "approx-prefix-cache-producer"
# Prompt blocks the prefix index looks at: 256 blocks of 16 tokens (4096 tokens) covers a long system
# prompt plus several turns; upstream's default.
MAX_PREFIX_BLOCKS = 256


def endpoint_picker_config(plan: SizingPlan, request_ttl_seconds: int, lora: bool = False) -> dict:
    """`request_ttl_seconds`: how long flow control holds a request that no pod can take (none ready, or
    all saturated) before it answers 503: the startup budget (plan/startup.py), so that a request sent
    to a service at zero replicas outlives the wake."""
    weights = {**WEIGHTS, **({"lora-affinity-scorer": LORA_WEIGHT} if lora else {})}
    return {
        "apiVersion": CONFIG_API_VERSION,
        "kind": "EndpointPickerConfig",
        # flowControl: the picker queues requests while the pool has no pod that can take one (none ready,
        # or all saturated) instead of failing them at once; the queue's size is the metric the
        # operator wakes a scaled-to-zero service on (inference_extension_flow_control_queue_size).
        "featureGates": ["flowControl"],
        "plugins": [
            # The prefix index, in the engine's own block size and capacity; autoTune then takes both from
            # each pod's vllm:cache_config_info (block_size, num_gpu_blocks) once it reports.
            {"type": PREFIX_PRODUCER, "parameters": {
                "autoTune": True, "blockSizeTokens": plan.block_size, "maxPrefixBlocksToMatch": MAX_PREFIX_BLOCKS,
                "lruCapacityPerServer": plan.kv_blocks}},
            *({"type": name} for name in weights),
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [
            *({"pluginRef": name, "weight": w} for name, w in weights.items()),
            {"pluginRef": "max-score-picker"},
        ]}],
        "flowControl": {"defaultRequestTTL": f"{request_ttl_seconds}s"},
    }
