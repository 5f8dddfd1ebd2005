"""Every child one InferenceService wants, from its spec, its plan and the replica count: the workload (a
Deployment, or a LeaderWorkerSet when a replica spans nodes), the Service, the PDB and the model cache claim."""

from dataclasses import dataclass

from tokenmill.operator.children.cache_pvc import desired_cache_claim
from tokenmill.operator.children.deployment import desired_deployment
from tokenmill.operator.children.leaderworkerset import desired_leaderworkerset, is_multi_node, leader_only
from tokenmill.operator.children.pdb import desired_pdb
from tokenmill.operator.children.pod import engine_args
from tokenmill.operator.children.service import desired_service
from tokenmill.operator.plan.sizing import SizingPlan, gpus_per_replica
from tokenmill.operator.plan.spec import ServiceSpec


@dataclass(frozen=True, slots=True)
class Desired:
    workload: dict  # a Deployment, or a LeaderWorkerSet
    summary: str  # what the workload's Created event says: replicas, their shape and the engine's argv
    service: dict
    pdb: dict | None  # None: the service runs one replica at most, and a PDB of ours goes
    cache_claim: dict | None  # None: no claim of ours (the user names one, or there is no cache)


def desired_children(spec: ServiceSpec, plan: SizingPlan, replicas: int, image: str,
                     hf_endpoint: str | None = None) -> Desired:
    multi = is_multi_node(plan)
    if multi:
        workload = desired_leaderworkerset(spec, plan, replicas, image, hf_endpoint)
        shape = f"groups of {plan.nodes_per_replica} pods x {plan.tensor_parallel_size}"
    else:
        workload = desired_deployment(spec, plan, replicas, image, hf_endpoint)
        shape = f"replicas x {gpus_per_replica(plan)}"
    summary = f"{replicas} {shape} {spec.gpu_type}, {' '.join(engine_args(spec, plan))}"
    return Desired(workload, summary, desired_service(spec, leader_only() if multi else None), desired_pdb(spec),
                   desired_cache_claim(spec))
