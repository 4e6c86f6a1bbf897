# syntax=docker/dockerfile:1
# Image for the local PD cluster: short prefills (--role pd-prefill) and all decoding (--role pd-decode).
#
#   docker build -f docker/local-pd.Dockerfile -t prfaas-sglang/local-pd:0.1.0 .
#   docker run --gpus all --network host prfaas-sglang/local-pd --role pd-decode --model-path /models/m
#
# Build context: the repository root. The SGLang base image must carry the
# pinned release (prfaas_sglang/_pin.py); tests/unit/test_docker.py checks that.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.15-cu130
ARG WIREGUARD_GO_BASE=debian:bookworm-slim

# wireguard-go, for the pod's tunnel where the host's kernel has no WireGuard module: Debian trixie's, the
# binary alone (scripts/install-wireguard-go.sh says why not an older one); any Debian base will do here.
FROM ${WIREGUARD_GO_BASE} AS wireguard-go
COPY scripts/install-wireguard-go.sh /tmp/
RUN bash /tmp/install-wireguard-go.sh /opt/wireguard-go

# Stage 1: the patched SGLang wheel (sglang-0.5.15+prfaas.<series-digest>) and
# this package's wheel, built with the same Python the runtime uses.
FROM ${SGLANG_IMAGE} AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY prfaas_sglang ./prfaas_sglang
COPY patches ./patches
RUN python3 -m pip wheel --no-deps -w /wheels . \
 && python3 -m pip install --no-deps /wheels/prfaas_sglang-*.whl \
 && python3 -m prfaas_sglang.patches lint \
 && python3 -m prfaas_sglang.patches apply --wheel-out /wheels

# Stage 2: the runtime. Replace the stock sglang with the patched wheel (same
# dependency set), add Mooncake's CUDA 13 transfer engine and this package.
FROM ${SGLANG_IMAGE}
COPY --from=builder /wheels /wheels
# iproute2, wireguard-tools, nftables, wireguard-go: the pod's tunnel on an encrypted link (launch --tunnel): the host
# kernel's WireGuard where it has the module (GPU hosts' kernels usually do), wireguard-go otherwise.
RUN apt-get update && apt-get install -y --no-install-recommends iproute2 wireguard-tools nftables && rm -rf /var/lib/apt/lists/*
COPY --from=wireguard-go /opt/wireguard-go/wireguard-go /usr/local/bin/wireguard-go
# The bind shim (Mooncake's listeners on the node's address) is compiled here, not at start.
ENV PRFAAS_NATIVE_DIR=/opt/prfaas/native
RUN python3 -m pip install --no-deps --force-reinstall /wheels/sglang-*+prfaas.*.whl \
 && python3 -m pip install mooncake-transfer-engine-cuda13 /wheels/prfaas_sglang-*.whl \
 && python3 -m prfaas_sglang.patches check \
 && python3 -m prfaas_sglang.native build \
 && rm -rf /wheels
# Cross-datacenter KV: prefer BBR on the host (sysctl net.ipv4.tcp_congestion_control=bbr);
# the Mooncake TCP WAN defaults are set by the launcher (prfaas_sglang/transport/wan_defaults.py).
ENTRYPOINT ["python3", "-m", "prfaas_sglang.launch"]
CMD ["--role", "pd-prefill"]
