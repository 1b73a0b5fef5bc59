# syntax=docker/dockerfile:1
# specd NVIDIA worker image: `specd worker --device cuda:0`, one GPU per container.
# Stage 1 (CUDA 12.8 devel) builds the specd wheel with SPECD_BACKEND=cuda for
# SPECD_CUDA_ARCHITECTURES (CMake syntax; the default covers Turing sm_75 to Hopper sm_90a as
# SASS, plus Blackwell sm_120 as SASS and PTX, which needs CUDA >= 12.8). CI compiles the
# cuda backend with the same list (tools/gpu_compile_check.sh reads the ARG line below).
# Stage 2 runs it on the CUDA base image: cudart is linked statically, so only the host
# driver (>= 525 through CUDA minor-version compatibility; the NVIDIA Container Toolkit
# mounts it) is needed at run time. No model inside: models live on the /data volume.
#
#   docker build -f docker/worker-cuda12.Dockerfile -t specd/worker-cuda12 .
#   docker build -f docker/worker-cuda12.Dockerfile --build-arg SPECD_CUDA_ARCHITECTURES="89-real" ...

FROM nvidia/cuda:12.8.1-devel-ubuntu24.04 AS build
ARG SPECD_CUDA_ARCHITECTURES="75-real;80-real;86-real;89-real;90a-real;120"
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev python3-venv g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY worker/ worker/
COPY gateway/ gateway/
COPY docker/healthcheck.py docker/
# pyproject's scikit-build-core defines read SPECD_BACKEND and SPECD_CUDA_ARCHITECTURES
# (the ARG above is in the environment of every RUN of this stage)
ENV SPECD_BACKEND=cuda CUDACXX=/usr/local/cuda/bin/nvcc PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/specd \
 && /opt/specd/bin/pip wheel --no-cache-dir --no-deps -w /tmp/wheels . \
 && /opt/specd/bin/pip install --no-cache-dir /tmp/wheels/specd-*.whl \
 && install -m 0755 docker/healthcheck.py /opt/specd/bin/specd-healthcheck

FROM nvidia/cuda:12.8.1-base-ubuntu24.04
# python3 is the same 3.12 the venv was made with (/usr/bin/python3, Ubuntu 24.04)
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 tini libstdc++6 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 specd \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin specd \
 && install -d -o 10001 -g 10001 /data
COPY --from=build /opt/specd /opt/specd
ENV PATH=/opt/specd/bin:$PATH \
    SPECD_HOME=/data \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/specd
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 CMD ["specd-healthcheck", "worker"]
ENTRYPOINT ["/usr/bin/tini", "--"]
# The container sees only its own GPU (device reservation / nvidia.com/gpu: 1), always index 0.
CMD ["specd", "worker", "--model", "demo", "--device", "cuda:0"]
