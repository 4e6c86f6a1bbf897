# syntax=docker/dockerfile:1
# Image for the control plane: the global scheduler (--role router) and the
# global KV index (--role kv-index). No GPU and no SGLang engine: it speaks
# SGLang's HTTP, PD-dispatch and KV-event protocols from the outside.
#
#   docker build -f docker/control-plane.Dockerfile -t prfaas-sglang/control-plane .
#   docker run --network host prfaas-sglang/control-plane --role router --config /etc/prfaas/topology.yaml --node router
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY prfaas_sglang ./prfaas_sglang
COPY patches ./patches
COPY launch /etc/prfaas/examples
RUN python3 -m pip install --no-cache-dir ".[router]" && rm -rf /src
WORKDIR /
ENTRYPOINT ["python3", "-m", "prfaas_sglang.launch"]
CMD ["--help"]
