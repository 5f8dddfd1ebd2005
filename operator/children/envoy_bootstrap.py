"""The standalone router's Envoy bootstrap (routing without a Gateway): one HTTP listener whose every
request goes through the endpoint picker (ext_proc, in the same pod) and then to the pod it named.

After the Gateway API Inference Extension's standalone chart (Envoy beside the picker in its pod):
- ext_proc to 127.0.0.1:EXT_PROC_PORT over TLS (the picker serves its self-signed certificate, as it
  does for gateways), FULL_DUPLEX_STREAMED bodies both ways: the picker reads the whole request (model,
  prompt) before it picks, and the response for its token metrics;
- an ORIGINAL_DST cluster that connects to the `x-gateway-destination-endpoint` header the picker sets;
- a readiness listener (/ready) and the admin interface on loopback only;
- every reply Envoy makes itself (the picker's 503 when a held request outlives its TTL, its 429, an
  unreachable pod) as an OpenAI-style JSON error, and a 503 with Retry-After.
"""

from tokenmill.operator.children.inferencepool import EXT_PROC_PORT

HTTP_PORT = 8081  # the listener clients reach (through the router Service's port 8000)
READY_PORT = 19001
ADMIN_PORT = 19000
DESTINATION_HEADER = "x-gateway-destination-endpoint"
# A 503 from the router means no pod could take the request within the queue TTL (none woke in time, or
# the pool is saturated): a client that waits this long and retries re-queues and keeps a wake going.
RETRY_AFTER_SECONDS = 10
# Past the TTL the picker answers itself; Envoy waits for the picker a little longer than that.
EXT_PROC_MARGIN_SECONDS = 30
# Generation streams for as long as it takes (long outputs on slow hardware): no route timeout of its own.
STREAM_TIMEOUT = "86400s"


def _typed(kind: str, **fields) -> dict:
    return {"@type": f"type.googleapis.com/{kind}", **fields}


def _ready_listener() -> dict:
    hcm = _typed("envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                 stat_prefix="ready",
                 route_config={"name": "ready", "virtual_hosts": [{"name": "ready", "domains": ["*"], "routes": [
                     {"match": {"prefix": "/stats/prometheus"}, "route": {"cluster": "admin"}}]}]},
                 http_filters=[
                     # Ready only while the picker answers its health check: a router pod whose Envoy is up
                     # before the picker listens would fail every request (seen: a 500 right after start).
                     {"name": "envoy.filters.http.health_check", "typed_config": _typed(
                         "envoy.extensions.filters.http.health_check.v3.HealthCheck", pass_through_mode=False,
                         headers=[{"name": ":path", "string_match": {"exact": "/ready"}}],
                         cluster_min_healthy_percentages={"ext_proc": {"value": 100}})},
                     {"name": "envoy.filters.http.router",
                      "typed_config": _typed("envoy.extensions.filters.http.router.v3.Router")}])
    return {"name": "ready", "address": {"socket_address": {"address": "0.0.0.0", "port_value": READY_PORT}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}]}


def _local_replies() -> dict:
    """OpenAI clients parse `{"error": {...}}`; the picker's own text goes in the message."""
    return {
        "mappers": [{
            "filter": {"status_code_filter": {"comparison": {"op": "EQ", "value": {
                "default_value": 503, "runtime_key": "router.retry_after_status"}}}},
            "headers_to_add": [{"header": {"key": "retry-after", "value": str(RETRY_AFTER_SECONDS)},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        }],
        "body_format": {"json_format": {"error": {"message": "%LOCAL_REPLY_BODY%", "type": "router_error",
                                                  "code": "%RESPONSE_CODE%"}}},
    }


def _http_listener(request_ttl_seconds: int) -> dict:
    ext_proc = _typed(
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service={"envoy_grpc": {"cluster_name": "ext_proc", "authority": f"localhost:{EXT_PROC_PORT}"}},
        processing_mode={"request_header_mode": "SEND", "response_header_mode": "SEND",
                         "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
                         "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
        # A request held by flow control waits for the picker's answer up to its TTL.
        message_timeout=f"{request_ttl_seconds + EXT_PROC_MARGIN_SECONDS}s",
        failure_mode_allow=False)
    hcm = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="http",
        route_config={"name": "pool", "virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": [{
            "match": {"prefix": "/"},
            "route": {"cluster": "pool", "timeout": STREAM_TIMEOUT, "idle_timeout": STREAM_TIMEOUT}}]}]},
        http_filters=[{"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
                      {"name": "envoy.filters.http.router", "typed_config": _typed(
                          "envoy.extensions.filters.http.router.v3.Router", suppress_envoy_headers=True)}],
        stream_idle_timeout=STREAM_TIMEOUT,
        local_reply_config=_local_replies(),
        use_remote_address=True,
        preserve_external_request_id=True,  # a client's x-request-id is kept: logs correlate end to end
        normalize_path=True,
        merge_slashes=True,
        access_log=[{"name": "envoy.access_loggers.stdout", "typed_config": _typed(
            "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog", log_format={"json_format": {
                "time": "%START_TIME%", "method": "%REQ(:METHOD)%", "path": "%REQ(:PATH)%",
                "request_id": "%REQ(X-REQUEST-ID)%", "code": "%RESPONSE_CODE%", "flags": "%RESPONSE_FLAGS%",
                "endpoint": f"%REQ({DESTINATION_HEADER.upper()})%", "upstream": "%UPSTREAM_HOST%",
                "duration_ms": "%DURATION%", "details": "%RESPONSE_CODE_DETAILS%"}})}],
    )
    return {"name": "http", "address": {"socket_address": {"address": "0.0.0.0", "port_value": HTTP_PORT}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}]}


def envoy_bootstrap(request_ttl_seconds: int) -> dict:
    http2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions", explicit_http_config={"http2_protocol_options": {}})}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": ADMIN_PORT}}},
        "static_resources": {
            "listeners": [_http_listener(request_ttl_seconds), _ready_listener()],
            "clusters": [
                {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "5s",
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}},
                {"name": "ext_proc", "type": "STATIC", "connect_timeout": "5s",
                 "typed_extension_protocol_options": http2,
                 "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": _typed(
                     "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                     common_tls_context={"validation_context": {}})},
                 # SERVING once the picker has synced its pool. no_traffic_interval: without it Envoy
                 # probes an idle cluster every 60 s and a picker not yet synced at the first probe
                 # stays out for a minute.
                 "health_checks": [{"timeout": "2s", "interval": "2s", "no_traffic_interval": "2s",
                                    "unhealthy_threshold": 3, "healthy_threshold": 1, "reuse_connection": True,
                                    "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
                                    "tls_options": {"alpn_protocols": ["h2"]}}],
                 "load_assignment": {"cluster_name": "ext_proc", "endpoints": [{"lb_endpoints": [{"endpoint": {
                     "address": {"socket_address": {"address": "127.0.0.1", "port_value": EXT_PROC_PORT}}}}]}]}},
                {"name": "admin", "type": "STATIC", "connect_timeout": "1s",
                 "load_assignment": {"cluster_name": "admin", "endpoints": [{"lb_endpoints": [{"endpoint": {
                     "address": {"socket_address": {"address": "127.0.0.1", "port_value": ADMIN_PORT}}}}]}]}},
            ],
        },
    }
