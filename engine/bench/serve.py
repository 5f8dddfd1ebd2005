"""`tokenmill bench serve`: vLLM's online methodology against any OpenAI-compatible server.

Streams /v1/completions (SSE) and timestamps each chunk on arrival. Prompts given as token ids are sent
as a token array (the OpenAI completions API allows it); outputs are forced to max_tokens with vLLM's
`ignore_eos` extension, and the token count comes from the streamed `usage` when the server sends it.
"""

import asyncio
import json
import time

import httpx
from tokenmill.engine.bench.datasets import BenchRequest
from tokenmill.engine.bench.serve_stats import RequestFuncOutput, arrival_times, calculate_metrics
from tqdm import tqdm


def completion_payload(model: str, req: BenchRequest, ignore_eos: bool = True) -> dict[str, object]:
    return {
        "model": model,
        "prompt": req.prompt if req.prompt is not None else req.prompt_token_ids,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }


async def send_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, object], prompt_len: int
) -> RequestFuncOutput:
    out = RequestFuncOutput(prompt_len=prompt_len)
    chunks = 0
    usage_tokens = None
    start = most_recent = time.perf_counter()
    out.start_time = start
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {body[:300]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    out.prompt_len = chunk["usage"].get("prompt_tokens") or out.prompt_len
                choices = chunk.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - most_recent)
                most_recent = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    if chunks == 0:
        out.error = "the stream carried no text"
        return out
    out.latency = most_recent - start
    # Without usage, one text chunk stands for one token (true for servers that stream token by token).
    out.output_tokens = usage_tokens if usage_tokens is not None else chunks
    out.success = True
    return out


async def run_serve_benchmark(
    base_url: str,
    model: str | None,
    requests: list[BenchRequest],
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    slo: dict[str, float] | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
    progress: bool = True,
) -> dict[str, object]:
    base = base_url.rstrip("/")
    offsets = arrival_times(len(requests), request_rate, burstiness, seed)  # validates before connecting
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        model = model or await first_model(client, base)
        url = f"{base}/v1/completions"
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), disable=not progress, desc="requests")

        async def one(req: BenchRequest, offset: float, t0: float) -> RequestFuncOutput:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            payload = completion_payload(model, req)
            prompt_len = len(req.prompt_token_ids) if req.prompt_token_ids is not None else 0
            if sem is None:
                result = await send_request(client, url, payload, prompt_len)
            else:
                async with sem:
                    result = await send_request(client, url, payload, prompt_len)
            bar.update(1)
            return result

        t0 = time.perf_counter()
        outputs = await asyncio.gather(*(one(r, off, t0) for r, off in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - t0
        bar.close()
    metrics = calculate_metrics(list(outputs), duration, slo)
    metrics.update(
        {
            "base_url": base_url,
            "model": model,
            "num_requests": len(requests),
            "request_rate": "inf" if request_rate == float("inf") else request_rate,
            "burstiness": burstiness,
            "max_concurrency": max_concurrency,
        }
    )
    return metrics


async def first_model(client: httpx.AsyncClient, base: str) -> str:
    resp = await client.get(f"{base}/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{base}/v1/models lists no model; pass --model")
    return data[0]["id"]
