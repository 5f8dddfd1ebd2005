"""Multi-turn chat through a routed InferenceService's endpoint picker against the same chats through the
plain Service: time to first token and the engines' prefix-cache hit rate, in one run.

The workload is what routing is for: conversations that share a system prompt, each turn resending the
whole conversation. Three paths, each with its own system prompt (so no path reuses another's cache):

- one replica: every request to one engine pod (the hit rate routing should come close to);
- router: every request to the router (Envoy -> endpoint picker -> the pod it chose);
- service: every request to a pod drawn at random, which is what a ClusterIP Service does per connection
  (kube-proxy's iptables rules pick a backend at random; a client's connection pool spreads a
  conversation's turns over connections). There is no kube-proxy here, so the draw is made here.

The hit rate is from the engines' own counters: the sum over the pool of the change in
vllm:prefix_cache_hits_total over the change in vllm:prefix_cache_queries_total (prompt tokens found in the
prefix cache / prompt tokens looked up) during the path's run.

    python e2e/routing_bench.py --kubeconfig .e2e/kubeconfig -n NAMESPACE NAME
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

WORDS = ("river", "lantern", "copper", "meadow", "signal", "harbor", "violet", "thunder", "saddle", "orbit",
         "pepper", "glacier", "ribbon", "falcon", "marble", "canyon", "velvet", "ember", "tunnel", "quartz")


def system_prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are assistant {seed}. Remember these words and answer briefly: {body}."


def user_turn(conversation: int, turn: int, seed: int, words: int = 60) -> str:
    """A turn that brings some text of its own (a note, a list) and a question about it."""
    rng = random.Random(seed * 1000 + conversation * 10 + turn)
    note = " ".join(rng.choice(WORDS) for _ in range(words))
    return (f"Conversation {conversation}, message {turn}. Here is my note: {note}. "
            f"Which of these words rhymes with {rng.choice(WORDS)}?")


@dataclass
class PathResult:
    name: str
    ttft: list[float] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0
    errors: list[str] = field(default_factory=list)
    served: list[int] = field(default_factory=list)  # requests each engine completed during the run

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def row(self) -> str:
        p50 = statistics.median(self.ttft) if self.ttft else float("nan")
        mean = statistics.fmean(self.ttft) if self.ttft else float("nan")
        return (f"{self.name:<14} {len(self.ttft):>8} {p50 * 1000:>10.0f} {mean * 1000:>10.0f} "
                f"{self.hit_rate:>9.1%} {'/'.join(map(str, self.served)):>12} {len(self.errors):>7}")


HEADER = (f"{'path':<14} {'requests':>8} {'TTFT p50':>10} {'TTFT mean':>10} {'hit rate':>9} {'per engine':>12} "
          f"{'errors':>7}\n{'':<14} {'':>8} {'(ms)':>10} {'(ms)':>10}")


def engine_counters(engine_urls: list[str]) -> tuple[float, float, list[float]]:
    """(prefix-cache hits, queries) summed over the engines, and each engine's completed requests, from
    their /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    hits = queries = 0.0
    done = []
    for url in engine_urls:
        done.append(0.0)
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            for family in text_string_to_metric_families(r.read().decode()):
                for s in family.samples:
                    if s.name == "vllm:prefix_cache_hits_total":
                        hits += s.value
                    elif s.name == "vllm:prefix_cache_queries_total":
                        queries += s.value
                    elif s.name == "vllm:request_success_total":
                        done[-1] += s.value
    return hits, queries, done


def chat_once(base_url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """(time to the first content token, the answer), streamed with the official client."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    t0 = time.monotonic()
    ttft, parts = None, []
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.monotonic() - t0
            parts.append(chunk.choices[0].delta.content)
    return (ttft if ttft is not None else time.monotonic() - t0), "".join(parts)


def run_path(name: str, pick_url, model: str, engine_urls: list[str], seed: int, conversations: int, turns: int,
             system_words: int, max_tokens: int, stagger: float) -> PathResult:
    """The conversations run side by side (one thread each, started `stagger` seconds apart: users do not
    arrive in one instant), every turn after the last one's answer."""
    result = PathResult(name)
    lock = threading.Lock()
    system = system_prompt(seed, system_words)
    h0, q0, d0 = engine_counters(engine_urls)

    def conversation(c: int) -> None:
        time.sleep(c * stagger)
        messages = [{"role": "system", "content": system}]
        for t in range(turns):
            messages.append({"role": "user", "content": user_turn(c, t, seed)})
            try:
                ttft, answer = chat_once(pick_url(), model, messages, max_tokens)
            except Exception as e:  # reported in the table and by the caller
                with lock:
                    result.errors.append(f"conversation {c} turn {t}: {e}")
                return
            messages.append({"role": "assistant", "content": answer})
            with lock:
                result.ttft.append(ttft)

    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(conversations)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    h1, q1, d1 = engine_counters(engine_urls)
    result.hits, result.queries = h1 - h0, q1 - q0
    result.served = [round(b - a) for a, b in zip(d0, d1, strict=True)]
    return result


def compare(router_url: str, engine_urls: list[str], model: str, conversations: int = 3, turns: int = 5,
            system_words: int = 60, max_tokens: int = 16, seed: int = 1, stagger: float = 0.5) -> list[PathResult]:
    """The three paths, one after the other, each with its own system prompt; returns their results."""
    draw = random.Random(seed)
    paths = [("one replica", lambda: engine_urls[0]), ("router", lambda: router_url),
             ("service", lambda: draw.choice(engine_urls))]
    return [run_path(name, pick, model, engine_urls, seed + i, conversations, turns, system_words, max_tokens,
                     stagger) for i, (name, pick) in enumerate(paths)]


def report(results: list[PathResult]) -> str:
    return "\n".join([HEADER, *(r.row() for r in results)])


def _kubectl_json(kubeconfig: str, *args: str) -> dict:
    out = subprocess.run(["kubectl", f"--kubeconfig={kubeconfig}", *args, "-o", "json"], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="e2e/routing_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("name", help="the routed InferenceService")
    p.add_argument("-n", "--namespace", default="default")
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    isvc = _kubectl_json(args.kubeconfig, "get", "inferenceservice", args.name, "-n", args.namespace)
    model = isvc["spec"]["model"].get("name") or args.name
    pods = _kubectl_json(args.kubeconfig, "get", "pods", "-n", args.namespace, "-l",
                         f"serving.tokenmill.dev/inferenceservice={args.name}")["items"]
    engines = [f"http://{p['status']['podIP']}:8000" for p in pods if p["status"].get("podIP")]
    routers = _kubectl_json(args.kubeconfig, "get", "pods", "-n", args.namespace, "-l",
                            f"serving.tokenmill.dev/router={args.name}")["items"]
    # No kube-proxy on the local cluster: the router Service's port 8000 is Envoy's port 8081 in its pod.
    router = f"http://{routers[0]['status']['podIP']}:8081"
    results = compare(router, engines, model, args.conversations, args.turns, max_tokens=args.max_tokens)
    print(report(results))
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
