# kvxferd on a GPU node: CUDA runtime, a UCX built with RDMA (verbs, rdmacm) and CUDA
# transports, the daemon as a non-root entrypoint, gRPC health as the container health check.
#
#   docker build -t kvxferd .
#   docker run --gpus all --ipc=host --pid=host --network=host --ulimit memlock=-1 \
#       --device=/dev/infiniband --cap-add=IPC_LOCK -v /run/kvxfer:/run/kvxfer kvxferd
#
# PyPI's UCX wheels (libucx-cu12) carry no RDMA transports, so the image builds UCX itself and
# tells the UCXX wheels to load it (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY). The UCX version
# matches the one the UCXX wheels were built against.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS ucx
ARG UCX_VERSION=1.21.0
# SHA-256 of ucx-1.21.0.tar.gz as published with the release; change both together.
ARG UCX_SHA256=2374d2fcf3186fbfd5e27633ab153aabaeb6b4f503a88563d2aca67cf51ed2c1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      autoconf automake ca-certificates curl g++ libibverbs-dev libnuma-dev libtool make \
      librdmacm-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN curl -fsSLo /tmp/ucx.tar.gz "https://github.com/openucx/ucx/releases/download/v${UCX_VERSION}/ucx-${UCX_VERSION}.tar.gz" \
 && echo "${UCX_SHA256}  /tmp/ucx.tar.gz" | sha256sum --check --strict \
 && tar -xzf /tmp/ucx.tar.gz --strip-components=1 \
 && rm /tmp/ucx.tar.gz \
 && ./contrib/configure-release --prefix=/opt/ucx --enable-mt --with-verbs --with-rdmacm \
      --with-cuda=/usr/local/cuda --without-java --without-go \
 && make -j"$(nproc)" install \
 && rm -rf /opt/ucx/lib/*.a /opt/ucx/lib/ucx/*.a

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      ibverbs-providers libibverbs1 libnuma1 librdmacm1 python3 python3-venv rdma-core \
 && rm -rf /var/lib/apt/lists/*
COPY --from=ucx /opt/ucx /opt/ucx
ENV PATH=/opt/kvxfer/bin:/opt/ucx/bin:$PATH \
    LD_LIBRARY_PATH=/opt/ucx/lib \
    RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true \
    KVXFER_SOCKET=/run/kvxfer/kvxferd.sock \
    KVXFERD_PEER_LISTEN=0.0.0.0:7461 \
    KVXFERD_ADMIN_LISTEN=0.0.0.0:7462 \
    KVXFERD_METRICS_LISTEN=0.0.0.0:7463 \
    KVXFERD_LOG_JSON=true \
    PYTHONUNBUFFERED=1

WORKDIR /opt/src/kvxfer
COPY pyproject.toml README.md LICENSE constraints.txt ./
COPY kvxferd ./kvxferd
COPY kvxfer_client ./kvxfer_client
COPY examples ./examples
RUN python3 -m venv /opt/kvxfer \
 && /opt/kvxfer/bin/pip install --no-cache-dir -c constraints.txt ".[cu12]" \
 && useradd --system --uid 10001 --user-group --home-dir /nonexistent --shell /usr/sbin/nologin kvxfer \
 && install -d -o kvxfer -g kvxfer -m 0750 /run/kvxfer

USER 10001:10001
EXPOSE 7461 7462 7463
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 CMD ["kvxferctl", "health"]
ENTRYPOINT ["kvxferd"]
