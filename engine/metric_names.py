"""Prometheus metric names: a contract with KEDA, the Gateway API Inference Extension, Grafana and
our own operator. Dependency-free so the operator can import it. prometheus_client appends
``_total`` to counters when exposing them."""

LABEL_MODEL = "model_name"

# Gauges
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
# LoRA (with --enable-lora), vLLM's exactly: value = the time of the last update, labels max_lora and the
# comma-joined names of the adapters with running / waiting requests; the endpoint picker's LoRA affinity
# reads the series with the latest value.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
# tokenmill's: one series per adapter the server was asked to serve, value 1, labels lora_name, status
# (loaded | failed) and reason (why it failed); the operator reads it into status.lora.
LORA_ADAPTER_INFO = "tokenmill:lora_adapter_info"

# Counters (exposed with a _total suffix)
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
NUM_PREEMPTIONS = "vllm:num_preemptions"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"

# Histograms
TTFT = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
E2E_LATENCY = "vllm:e2e_request_latency_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
ITERATION_TOKENS = "vllm:iteration_tokens_total"

# tokenmill's capacity gauges, read by the operator into status.sizing.measured
KV_CAPACITY_TOKENS = "tokenmill:kv_cache_capacity_tokens"
MAX_CONCURRENCY = "tokenmill:max_concurrency_at_max_model_len"
MAX_MODEL_LEN = "tokenmill:max_model_len"
MODEL_LOAD_SECONDS = "tokenmill:model_load_seconds"
