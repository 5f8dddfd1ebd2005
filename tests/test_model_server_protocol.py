"""What a router in front of the engine relies on, against one real `tokenmill serve` process (a tiny
random Llama with the bundled tokenizer: these behaviours do not depend on what the model says):

- Chunked request bodies: Envoy forwards a body the endpoint picker has read as Transfer-Encoding:
  chunked with no Content-Length. A raw socket sends exactly that (chunk boundaries inside the JSON) to
  /v1/completions and /v1/chat/completions, streamed and not; a body over --max-request-body-bytes gets
  an OpenAI-format 413 (chunked or declared), malformed chunk framing a 400, and the server stays up.
- KV-cache events (--kv-events-config) from the server's engine-core process: the block hashes a
  subscriber receives are the chained SHA-256 keys docs/serving.md defines, computed here from the
  token ids alone (cache_salt included); POST /reset_prefix_cache clears them (AllBlocksCleared), and
  is refused with a 409 while a request holds blocks.
- The metrics an endpoint picker reads exist with the type and labels it parses (the real EPP's own
  parser reads them in e2e/test_epp_metrics.py).
"""

import hashlib
import json
import socket
import struct
import threading
import time

import httpx
import pytest
from conftest_server import serving, wait_idle
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import make_tiny_model

from tests.kv_events_subscriber import KVEventSubscriber

MODEL = "tiny"
BS = 16
BODY_LIMIT = 64 * 1024
ROOT_HASH = hashlib.sha256(b"tokenmill prefix cache root").digest()  # docs/serving.md, "KV-cache events"


@pytest.fixture(scope="module")
def server(tmp_path_factory, bundled_model_dir):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", tokenizer_dir=bundled_model_dir)
    folder = tmp_path_factory.mktemp("kv-events")
    events, replay = f"ipc://{folder}/events", f"ipc://{folder}/replay"  # ipc:// binds, as a wildcard does
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events, "replay_endpoint": replay,
              "topic": f"kv@pod-a@{MODEL}"}  # fmt: skip
    sub = KVEventSubscriber(events, bind=False, replay_endpoint=replay, topic=b"kv@pod-a@")
    try:
        for s in serving(
            "--model", str(model), "--served-model-name", MODEL, "--max-model-len", "512", "--num-kv-blocks", "64",
            "--dtype", "float32", "--max-request-body-bytes", str(BODY_LIMIT), "--kv-events-config", json.dumps(config),
            log_dir=tmp_path_factory.mktemp("serve"),
        ):  # fmt: skip
            s.subscriber = sub
            yield s
    finally:
        sub.close()


# ---- a raw HTTP/1.1 client -----------------------------------------------------------------------
def dechunk(body: bytes) -> bytes:
    out, rest = b"", body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return out
        out, rest = out + rest[:size], rest[size + 2 :]
    raise AssertionError("chunked response body without its last chunk")


def raw_post(server, path: str, chunks: list[bytes], headers: str = "") -> tuple[int, dict[str, str], bytes]:
    """POST path with the body sent as these chunks (Transfer-Encoding: chunked, no Content-Length), a
    little apart as a proxy streams them; (status, headers, body) of the answer, read to the close."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: chunked\r\nConnection: close\r\n{headers}\r\n".encode()
        )
        try:
            for chunk in chunks:
                sock.sendall(chunk)
                time.sleep(0.01)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered (413, 400) and closed before the rest was sent
        data = b""
        while True:
            try:
                got = sock.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            data += got
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if hdrs.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return status, hdrs, body


def as_chunks(payload: bytes, n: int = 4) -> list[bytes]:
    """The payload cut into n pieces (cuts land inside JSON strings and numbers), each framed as a chunk,
    then the last chunk."""
    step = -(-len(payload) // n)
    pieces = [payload[i : i + step] for i in range(0, len(payload), step)]
    return [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces] + [b"0\r\n\r\n"]


def sse_events(body: bytes) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in body.decode().split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- chunked request bodies ----------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_chunked_completions(server, stream) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time, in a land far away,", "max_tokens": 5,
            "temperature": 0, "stream": stream}  # fmt: skip
    status, headers, got = raw_post(server, "/v1/completions", as_chunks(json.dumps(body).encode()))
    assert status == 200, got
    if stream:
        assert headers["content-type"].startswith("text/event-stream")
        events = sse_events(got)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        text = "".join(e["choices"][0]["text"] for e in events)
    else:
        r = json.loads(got)
        assert r["usage"]["completion_tokens"] == 5
        text = r["choices"][0]["text"]
    # The same request with a Content-Length gives the same greedy text: the body arrived whole.
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=120).json()
    assert text == plain["choices"][0]["text"]


def test_chunked_streamed_chat_completion(server) -> None:
    """(Not streamed, a chunked chat body is test_server_openai.py's test_chunked_request_bodies_are_read_whole.)"""
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Answer briefly. " * 8},
                                         {"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 4, "temperature": 0, "stream": True}  # fmt: skip
    status, _, got = raw_post(server, "/v1/chat/completions", as_chunks(json.dumps(body).encode(), n=7))
    assert status == 200, got
    events = sse_events(got)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    plain = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": False}, timeout=120).json()
    assert text == plain["choices"][0]["message"]["content"]


def test_oversize_chunked_body_gets_a_413_naming_the_limit(server) -> None:
    payload = json.dumps({"model": MODEL, "prompt": "x " * BODY_LIMIT, "max_tokens": 1}).encode()
    status, _, got = raw_post(server, "/v1/completions", as_chunks(payload, n=16))
    assert status == 413, got
    err = json.loads(got)["error"]
    assert f"limit of {BODY_LIMIT} bytes" in err["message"] and "--max-request-body-bytes" in err["message"]
    assert "so far" in err["message"]  # refused while the chunks were still arriving
    assert err["type"] == "invalid_request_error"
    # Declared too large: refused before the body is read.
    r = httpx.post(f"{server.url}/v1/completions", content=payload, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "declared" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize(
    "framing",
    [
        [b"zz\r\n{}\r\n0\r\n\r\n"],  # a chunk size that is not hex
        [b"2\r\n{\"model\": 1}\r\n0\r\n\r\n"],  # a chunk longer than its size says
    ],
)
def test_malformed_chunked_body_gets_a_400_and_the_server_stays_up(server, framing) -> None:
    status, _, got = raw_post(server, "/v1/completions", framing)
    assert status == 400, got
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200


# ---- KV-cache events from the server -------------------------------------------------------------
def chain(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """The block keys of tokens' full blocks, from docs/serving.md: SHA-256 over the parent key, the block's
    tokens as little-endian int64, and (first block only) the salt as a 4-byte little-endian length and
    its UTF-8 bytes."""
    keys, parent = [], ROOT_HASH
    for i in range(len(tokens) // BS):
        extra = b"" if salt is None or i else len(salt.encode()).to_bytes(4, "little") + salt.encode()
        parent = hashlib.sha256(parent + struct.pack(f"<{BS}q", *tokens[i * BS : (i + 1) * BS]) + extra).digest()
        keys.append(parent)
    return keys


def published(server) -> None:
    """Wait until the events of the requests so far have arrived (each step sends its batch at once)."""
    wait_idle(server)
    time.sleep(0.3)
    sub = server.subscriber
    while sub.sub.poll(300):
        sub.drain_until(sub.next_seq + 1)


def complete(server, prompt: list[int], max_tokens: int = 2, **extra) -> None:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})  # fmt: skip
    assert r.status_code == 200, r.text


def test_kv_events_carry_the_prefix_cache_keys_and_reset_clears_them(server) -> None:
    sub = server.subscriber
    tokens = [(37 * i + 11) % 40000 for i in range(3 * BS + 5)]
    complete(server, tokens)
    complete(server, tokens, cache_salt="tenant-a")
    published(server)
    assert sub.topics == {f"kv@pod-a@{MODEL}".encode()}
    assert set(chain(tokens)) <= sub.blocks and set(chain(tokens, "tenant-a")) <= sub.blocks
    stored = {tuple(e[1]): e for e in sub.stored}
    assert stored[tuple(chain(tokens))][3] == tokens[: 3 * BS]  # the blocks' tokens, as sent
    assert stored[tuple(chain(tokens, "tenant-a"))][8] == [["tenant-a"], None, None]

    # A reset while a request holds blocks is refused, and changes nothing.
    long_request = threading.Thread(target=complete, args=(server, tokens[:20], 400), kwargs={"ignore_eos": True})
    long_request.start()
    server.wait_metric("vllm:num_requests_running", lambda v: v == 1, timeout_s=60)
    r = httpx.post(f"{server.url}/reset_prefix_cache")
    assert r.status_code == 409 and "retry when the engine is idle" in r.json()["error"]["message"]
    long_request.join()
    published(server)
    assert sub.counts["AllBlocksCleared"] == 0 and sub.blocks

    r = httpx.post(f"{server.url}/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"reset": True}
    published(server)
    assert sub.counts["AllBlocksCleared"] == 1 and sub.blocks == set()
    complete(server, tokens)  # the cache fills again, under the same keys
    published(server)
    assert set(chain(tokens)) == sub.blocks & set(chain(tokens))


# ---- the metrics a router reads ------------------------------------------------------------------
def test_metrics_a_router_reads_have_its_types_and_labels(server) -> None:
    """The endpoint picker's vLLM mapping (its extractor/metrics/factories.go): three gauges read by value
    and an info gauge read by its block_size / num_gpu_blocks labels, which it parses as integers."""
    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge" and len(families[name].samples) == 1
    [info] = families["vllm:cache_config_info"].samples
    assert families["vllm:cache_config_info"].type == "gauge" and info.value == 1
    assert (int(info.labels["block_size"]), int(info.labels["num_gpu_blocks"])) == (BS, 64)
