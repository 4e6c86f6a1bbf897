# syntax=docker/dockerfile:1
# Image for the control plane: the global scheduler (--role router) and the
# global KV index (--role kv-index). No GPU and no SGLang engine: it speaks
# SGLang's HTTP, PD-dispatch and KV-event protocols from the outside. It also
# carries the emulated engine (--engine mock: GPU-less deployments, e.g. the
# manifests of `launch --emit k8s --engine mock` on a CPU Kubernetes cluster),
# which ships KV over Mooncake TCP (libibverbs1, libnuma1, libcurl4: Mooncake's engine links them, checked
# against the wheel's own NEEDED entries by tests/unit/test_docker.py; iproute2:
# `ss`, through which an emulated PrfaaS worker's link telemetry reads its lanes' TCP state,
# the congestion flag and a capacity that moves within a transfer).
#
#   docker build -f docker/control-plane.Dockerfile -t prfaas-sglang/control-plane:0.1.0 .
#   docker run --network host prfaas-sglang/control-plane --role router --config /etc/prfaas/topology.yaml --node router
ARG PYTHON_IMAGE=python:3.11-slim
ARG WIREGUARD_GO_BASE=debian:bookworm-slim

# wireguard-go, for the pod's tunnel where the host's kernel has no WireGuard module: Debian trixie's, the
# binary alone (scripts/install-wireguard-go.sh says why not an older one); any Debian base will do here.
FROM ${WIREGUARD_GO_BASE} AS wireguard-go
COPY scripts/install-wireguard-go.sh /tmp/
RUN bash /tmp/install-wireguard-go.sh /opt/wireguard-go

FROM ${PYTHON_IMAGE}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY prfaas_sglang ./prfaas_sglang
COPY patches ./patches
COPY launch /etc/prfaas/examples
# wireguard-go, wireguard-tools, nftables: a pod on an encrypted link holds its tunnel (launch --tunnel, the
# manifests' `tunnel` container): the kernel's WireGuard where the host has the module, wireguard-go otherwise.
COPY --from=wireguard-go /opt/wireguard-go/wireguard-go /usr/local/bin/wireguard-go
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 iproute2 \
    wireguard-tools nftables && rm -rf /var/lib/apt/lists/* \
 && python3 -m pip install --no-cache-dir ".[router,mock]" && rm -rf /src
WORKDIR /
ENTRYPOINT ["python3", "-m", "prfaas_sglang.launch"]
CMD ["--help"]
