"""`tokenmill operator`: run the Kubernetes operator (Kopf) in this process.

Credentials: --kubeconfig FILE (or $KUBECONFIG) wins; inside a pod the ServiceAccount is used. That is
how e2e runs it as a local process with the chart's ServiceAccount token in a kubeconfig.
"""

import argparse
import logging
import os
import random
import sys

from tokenmill.operator.children.pod import DEFAULT_ENGINE_IMAGE
from tokenmill.operator.children.router import (
    DEFAULT_ENVOY_IMAGE,
    DEFAULT_EPP_IMAGE,
    EPP_CLUSTER_ROLE_DEFAULT,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill operator", description="Run the tokenmill Kubernetes operator.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable); default: all namespaces")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    p.add_argument("--peering", metavar="NAME", default=None,
                   help="coordinate replicas through the (Cluster)KopfPeering NAME so that only one acts; "
                        "without it the operator runs standalone")
    p.add_argument("--priority", type=int, default=None,
                   help="peering priority (highest acts); default random, so that replicas differ")
    p.add_argument("--liveness", metavar="URL", default=None,
                   help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, then in-cluster)")
    p.add_argument("--engine-image", default=os.environ.get("TOKENMILL_ENGINE_IMAGE", DEFAULT_ENGINE_IMAGE),
                   help="engine image for pods whose spec.template.image is unset ($TOKENMILL_ENGINE_IMAGE)")
    p.add_argument("--hf-endpoint", default=os.environ.get("HF_ENDPOINT") or None, metavar="URL",
                   help="Hugging Face Hub URL for hf:// models ($HF_ENDPOINT; default the public Hub): the "
                        "operator's own lookups use it and engine pods get it as HF_ENDPOINT")
    p.add_argument("--epp-image", default=os.environ.get("TOKENMILL_EPP_IMAGE", DEFAULT_EPP_IMAGE),
                   help="endpoint picker image of routed services (spec.routing) ($TOKENMILL_EPP_IMAGE)")
    p.add_argument("--envoy-image", default=os.environ.get("TOKENMILL_ENVOY_IMAGE", DEFAULT_ENVOY_IMAGE),
                   help="Envoy image of routed services without a Gateway ($TOKENMILL_ENVOY_IMAGE)")
    p.add_argument("--epp-cluster-role", default=EPP_CLUSTER_ROLE_DEFAULT, metavar="NAME",
                   help="the ClusterRole with the endpoint picker's rights (the chart's <release>-epp), bound to "
                        "each router's ServiceAccount in its namespace; the operator needs `bind` on it")
    p.add_argument("--interval", type=float, default=15.0,
                   help="seconds between autoscaling and drift-correction passes per InferenceService")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve the operator's Prometheus metrics on this port (0: off)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.interval <= 0:
        print(f"tokenmill operator: --interval must be positive, got {args.interval}", file=sys.stderr)
        return 2
    if args.kubeconfig:
        if not os.path.exists(args.kubeconfig):
            print(f"tokenmill operator: --kubeconfig {args.kubeconfig} does not exist", file=sys.stderr)
            return 2
        os.environ["KUBECONFIG"] = args.kubeconfig
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # One line per scrape and per handled watch event drowns the decisions; keep those at INFO.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)

    from tokenmill.operator import handlers
    from tokenmill.operator.children.router import RouterSettings
    from tokenmill.operator.reconcile import OperatorConfig
    from tokenmill.operator.self_metrics import serve as serve_metrics

    config = OperatorConfig(engine_image=args.engine_image, interval=args.interval,
                            hf_endpoint=args.hf_endpoint.rstrip("/") if args.hf_endpoint else None,
                            router=RouterSettings(args.epp_image, args.envoy_image, args.epp_cluster_role))
    priority = None
    if args.peering:
        # Kopf pauses every operator that sees a live peer of equal priority: replicas need distinct ones.
        priority = args.priority if args.priority is not None else random.randint(1, 2**31 - 1)
    if args.metrics_port:
        serve_metrics(args.metrics_port)
    try:
        handlers.run(config, namespaces=args.namespace, peering=args.peering, priority=priority,
                     liveness=args.liveness)
    except KeyboardInterrupt:
        return 0
    except Exception as e:
        print(f"tokenmill operator: {e}", file=sys.stderr)
        return 1
    return 0
