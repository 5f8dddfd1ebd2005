"""The API process of a real `tokenmill serve` (bundled model) never loads torch: the engine core, its
child, runs the model; the API process tokenizes, renders chat templates, detokenizes and serves HTTP.
Torch there would cost about 500 MB of RSS per replica (engine/model/resolve.py says how it is avoided).
"""

import json
import pathlib

import openai
import pytest
from conftest_server import serving

LIBTORCH = "libtorch_cpu.so"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(
        "--max-model-len", "512", "--num-kv-blocks", "64", "--max-num-seqs", "4", "--dtype", "float32",
        log_dir=tmp_path_factory.mktemp("serve"),
    )  # fmt: skip


def mapped_libraries(pid: int) -> set[str]:
    maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
    return {line.rsplit("/", 1)[-1] for line in maps.splitlines() if "/" in line}


def vm_rss_mb(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def test_api_process_serves_chat_without_torch_and_structured_outputs_still_work(server):
    api, core = server.proc.pid, server.core_pid()
    # The same check on the engine core shows it can see libtorch where it is loaded.
    assert LIBTORCH in mapped_libraries(core)
    assert LIBTORCH not in mapped_libraries(api), "the API process loaded torch at startup"

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, max_tokens=16, temperature=0
    )
    assert "Paris" in reply.choices[0].message.content
    assert LIBTORCH not in mapped_libraries(api), "a chat completion made the API process load torch"
    print(f"VmRSS after a chat completion: API process {vm_rss_mb(api)} MB, engine core {vm_rss_mb(core)} MB")

    # transformers was imported with torch hidden; xgrammar (grammar validation in the API process)
    # imports torch later, on the first structured request: that must still work.
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Describe Paris as a JSON object."}],
        max_tokens=24,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": {
            "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
            "additionalProperties": False}}},
    )  # fmt: skip
    assert reply.choices[0].message.content.lstrip().startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert set(json.loads(reply.choices[0].message.content)) == {"name"}
