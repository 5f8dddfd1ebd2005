"""Every child one InferenceService wants, from its spec, its plan and the replica count: the workload (a
Deployment, or a LeaderWorkerSet when a replica spans nodes), the Service, the PDB and the model cache claim."""

from dataclasses import dataclass, field

from tokenmill.operator.children.cache_pvc import desired_cache_claim
from tokenmill.operator.children.deployment import desired_deployment
from tokenmill.operator.children.httproute import desired_httproute
from tokenmill.operator.children.inferencepool import desired_inference_pool
from tokenmill.operator.children.leaderworkerset import desired_leaderworkerset, is_multi_node, leader_only
from tokenmill.operator.children.lora_config import desired_lora_config
from tokenmill.operator.children.pdb import desired_pdb
from tokenmill.operator.children.pod import engine_args
from tokenmill.operator.children.router import RouterSettings, desired_router
from tokenmill.operator.children.service import desired_service
from tokenmill.operator.plan.sizing import SizingPlan, gpus_per_replica
from tokenmill.operator.plan.spec import ServiceSpec
from tokenmill.operator.plan.startup import startup_timeout_seconds


@dataclass(frozen=True, slots=True)
class Desired:
    workload: dict  # a Deployment, or a LeaderWorkerSet
    summary: str  # what the workload's Created event says: replicas, their shape and the engine's argv
    service: dict
    pdb: dict | None  # None: the service runs one replica at most, and a PDB of ours goes
    cache_claim: dict | None  # None: no claim of ours (the user names one, or there is no cache)
    lora_config: dict | None = None  # spec.model.lora's ConfigMap (children/lora_config.py); None: no adapters
    # spec.routing: the router's children in apply order (ServiceAccount, RoleBinding, ConfigMap, Deployment,
    # Service, InferencePool, and the HTTPRoute in gateway mode); empty without routing.
    router: list[dict] = field(default_factory=list)


def desired_children(spec: ServiceSpec, plan: SizingPlan, replicas: int, image: str,
                     hf_endpoint: str | None = None, router: RouterSettings | None = None) -> Desired:
    multi = is_multi_node(plan)
    if multi:
        workload = desired_leaderworkerset(spec, plan, replicas, image, hf_endpoint)
        shape = f"groups of {plan.nodes_per_replica} pods x {plan.tensor_parallel_size}"
    else:
        workload = desired_deployment(spec, plan, replicas, image, hf_endpoint)
        shape = f"replicas x {gpus_per_replica(plan)}"
    summary = f"{replicas} {shape} {spec.gpu_type}, {' '.join(engine_args(spec, plan))}"
    only = leader_only() if multi else None
    routed = []
    if spec.routing is not None:
        # The router's queue TTL is the startup budget: a request held while the service wakes from zero
        # outlives the slowest start the probes allow.
        routed = [*desired_router(spec, plan, startup_timeout_seconds(spec, plan), router or RouterSettings()),
                  desired_inference_pool(spec, only)]
        if spec.routing.gateway_name is not None:
            routed.append(desired_httproute(spec))
    return Desired(workload, summary, desired_service(spec, only), desired_pdb(spec), desired_cache_claim(spec),
                   desired_lora_config(spec), routed)
