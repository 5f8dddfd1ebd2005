"""tokenmill.operator: the Kubernetes operator that serves InferenceServices.

Imports run one way. A unit may import only the units listed after its arrow (and the standard library
and third-party packages); nothing imports a unit above it, so there are no circles:

    cli        -> handlers, reconcile, self_metrics, children, plan
    handlers   -> reconcile, kube, leadership, self_metrics, children, plan    (the only importer of kopf)
    reconcile  -> status, apply, observe, children, plan
    status     -> apply, observe, kube, children, plan
    apply      -> observe, children, plan
    observe    -> kube, children, plan
    kube       -> plan
    children   -> plan
    plan       -> tokenmill.engine's torch-free leaves only: kv_memory, metric_names, config, parallel_check
    leadership, self_metrics -> nothing of tokenmill

A unit is a subpackage (plan/, observe/, children/, cli/) or a top-level module. Inside a subpackage,
modules import each other without circles. Importing any module but handlers.py loads neither kopf nor
torch nor an engine runtime (cli/run.py imports handlers only when the operator starts).

One reconcile (reconcile.py) runs the stages in order:
  observe/   read the world: the children and pods (cluster.py), Secrets, the Hugging Face Hub (hub.py,
             hub_lookup.py), the engines' /metrics or Prometheus (engine_metrics.py);
  plan/      pure decisions: the spec parsed (spec.py), catalogs and profiles, the sizing plan (sizing.py),
             the replica count (replicas.py, autoscaler.py, quota.py), the conditions (conditions.py);
             observations.py holds the values observe/ hands to plan/;
  children/  pure desired manifests, one module per kind: deployment, service, pdb, leaderworkerset,
             cache_pvc, over pod.py (the engine pod) and meta.py (labels, owner reference); desired.py
             gathers them;
  apply.py   server-side apply of what drifted, deletions, their events;
  status.py  the status fields, the conditions merged, the events, one status patch.
handlers.py wires Kopf to reconcile; kube.py is the REST client; self_metrics.py the operator's own
/metrics; leadership.py the peering rule; cli/ the `tokenmill size` and `tokenmill operator` commands.
"""
