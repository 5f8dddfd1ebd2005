"""Autoscaling end to end: real `tokenmill serve` engines, Debian's Prometheus scraping them under the
fake pods' labels, the operator reading Prometheus and scaling the Deployment up under a burst and
back down once the load is over and the stabilization window has passed."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from cluster import Cluster
from e2e_helpers import (
    ISVC,
    OperatorProcess,
    apply,
    condition,
    get,
    items,
    ready_for_current_generation,
    wait_for,
)
from engines import Load, PodTargets, queue_depth, start_engine, start_prometheus

MAX_REPLICAS = 2  # one real engine per possible replica; two engines is what 2 cores carry
TARGET_QUEUE_DEPTH = 2  # waiting + running requests per replica
MAX_NUM_SEQS = 2  # small, so a modest burst queues
SCALE_DOWN_WINDOW_S = 30
SERVED_NAME = "smollm2"


def test_queue_depth_scales_the_deployment_up_and_back_down(cluster: Cluster, operator: OperatorProcess,
                                                            namespace: str, tmp_path: Path) -> None:
    # Every process is stopped however the test ends: each registers its cleanup as soon as it exists.
    with contextlib.ExitStack() as cleanup:
        engines = []
        for _ in range(MAX_REPLICAS):
            proc, url = start_engine(tmp_path, SERVED_NAME, MAX_NUM_SEQS)
            cleanup.callback(proc.stop)
            engines.append(url)
        targets_file = tmp_path / "targets.json"
        prometheus, prom_url = start_prometheus(tmp_path, targets_file)
        cleanup.callback(prometheus.stop)
        targets = PodTargets(cluster, namespace, "serving.tokenmill.dev/inferenceservice=chat", engines,
                             targets_file)
        targets.start()
        cleanup.callback(targets.stop)

        apply(cluster, {
            "apiVersion": "serving.tokenmill.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat"},
            "spec": {"model": {"uri": "bundled://smollm2-135m-instruct", "name": SERVED_NAME},
                     "resources": {"gpu": {"type": "nvidia-l4", "count": 1}},
                     "scaling": {"minReplicas": 1, "maxReplicas": MAX_REPLICAS,
                                 "targetQueueDepth": TARGET_QUEUE_DEPTH, "scaleUpStabilizationSeconds": 0,
                                 "scaleDownStabilizationSeconds": SCALE_DOWN_WINDOW_S,
                                 "metrics": {"source": "prometheus", "url": prom_url}}}}, namespace)

        # Idle: one replica, and the operator reads Prometheus (ScalingActive=True) before any load.
        wait_for(lambda: (o := get(cluster, ISVC, "chat", namespace)) and ready_for_current_generation(o)
                 and condition(o, "ScalingActive")["status"] == "True",
                 "Ready=True and ScalingActive=True at idle", timeout=120)
        assert get(cluster, "deployment", "chat", namespace)["spec"]["replicas"] == 1
        first_engine = targets.engine_of_first_pod()

        # A burst: far more requests than one replica's target keeps in flight.
        sizes: list[tuple[float, int]] = []

        def replicas() -> int:
            n = get(cluster, "deployment", "chat", namespace)["spec"]["replicas"]
            if not sizes or sizes[-1][1] != n:
                sizes.append((time.monotonic(), n))
            return n

        load = Load(first_engine, SERVED_NAME, concurrency=4 * TARGET_QUEUE_DEPTH, max_tokens=32).start()
        cleanup.callback(load.stop)
        load_start = time.monotonic()
        wait_for(lambda: replicas() == MAX_REPLICAS, f"scale-up to {MAX_REPLICAS} under load", timeout=150)
        # Both replicas become ready, and the new pod is scraped too.
        wait_for(lambda: len(targets.assigned) == MAX_REPLICAS, "both pods mapped to engines", timeout=60)
        time.sleep(3)
        assert replicas() == MAX_REPLICAS  # held while the load lasts
        # The load ends: no new requests. The moment the engine's own queue depth falls to one replica's
        # target is when one replica becomes enough (measured here, not taken from the operator).
        load.stop_sending()
        load_end = wait_for(lambda: queue_depth(first_engine) <= TARGET_QUEUE_DEPTH and time.monotonic(),
                            "the burst to drain", timeout=150, interval=0.25)
        load.stop()
        assert load.completed > 0 and not load.errors, load.errors[:5]

        wait_for(lambda: replicas() == 1, "scale-down to 1 after the load", timeout=SCALE_DOWN_WINDOW_S + 120)
        scale_down_at = sizes[-1][0]
        print(f"replicas over time (s from load start): {[(round(t - load_start, 1), n) for t, n in sizes]}; "
              f"queue at or below target from {load_end - load_start:.1f}s; {load.completed} completions")
        # The stabilization window held the size for a while after one replica became enough (without
        # it, the next reconcile pass, 2 s and one scrape later, would have scaled down).
        assert scale_down_at - load_end >= SCALE_DOWN_WINDOW_S / 2, (scale_down_at - load_end, sizes)
        assert [n for _, n in sizes] == [1, MAX_REPLICAS, 1], sizes  # no flapping
        assert not targets.unmapped, f"pods beyond maxReplicas appeared: {targets.unmapped}"

        events = [(e["reason"], e["message"]) for e in items(cluster, "events", namespace)
                  if e["involvedObject"]["kind"] == "InferenceService"]
        assert any(r == "ScaledUp" and f"to {MAX_REPLICAS} replicas" in m for r, m in events), events
        assert any(r == "ScaledDown" and "to 1 replicas" in m for r, m in events), events
        # One decision each way over the whole run (the polling above could miss a flap between polls).
        assert [r for r, _ in events].count("ScaledUp") == 1 and [r for r, _ in events].count("ScaledDown") == 1
        obj = get(cluster, ISVC, "chat", namespace)
        print(f"status.scaling: {json.dumps(obj['status']['scaling'])}\nevents: {events}")
        assert obj["status"]["scaling"]["targetQueueDepth"] == TARGET_QUEUE_DEPTH
        # The engines' reported capacity flowed back into the status (the closed loop).
        measured = obj["status"]["sizing"].get("measured") or {}
        assert measured.get("kvTokens", 0) > 0, json.dumps(obj["status"]["sizing"])
