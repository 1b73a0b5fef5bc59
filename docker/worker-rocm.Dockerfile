# syntax=docker/dockerfile:1
# specd AMD worker image: `specd worker --device hip:0`, one GPU per container.
# Stage 1 (ROCm 6.4 dev image) builds the specd wheel with SPECD_BACKEND=hip: the CUDA
# sources compiled by hipcc (/opt/rocm/bin, the C++ compiler of the whole module) for
# SPECD_HIP_ARCHITECTURES: CDNA2 gfx90a (MI200), RDNA3 gfx1100 (RX 7900), RDNA3.5 gfx1151
# (Ryzen AI Max "Strix Halo"), RDNA4 gfx1201 (RX 9070). CI compiles the hip backend with the
# same list (tools/gpu_compile_check.sh reads the ARG line below).
# Stage 2 is Ubuntu 24.04 with only the HIP runtime of the same ROCm release from AMD's apt
# repository. The host needs the amdgpu kernel driver; the container gets /dev/kfd and
# /dev/dri and must be in the groups that own them (compose: group_add; Kubernetes: the
# AMD device plugin plus supplementalGroups). No model inside: models live on /data.
#
#   docker build -f docker/worker-rocm.Dockerfile -t specd/worker-rocm .
#   docker build -f docker/worker-rocm.Dockerfile --build-arg SPECD_HIP_ARCHITECTURES="gfx1100" ...

FROM rocm/dev-ubuntu-24.04:6.4.1 AS build
ARG SPECD_HIP_ARCHITECTURES="gfx90a;gfx1100;gfx1151;gfx1201"
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev python3-venv g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY worker/ worker/
COPY gateway/ gateway/
COPY docker/healthcheck.py docker/
# pyproject's scikit-build-core defines read SPECD_BACKEND and SPECD_HIP_ARCHITECTURES
# (the ARG above is in the environment of every RUN of this stage)
ENV SPECD_BACKEND=hip ROCM_PATH=/opt/rocm PATH=/opt/rocm/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/specd \
 && /opt/specd/bin/pip wheel --no-cache-dir --no-deps -w /tmp/wheels . \
 && /opt/specd/bin/pip install --no-cache-dir /tmp/wheels/specd-*.whl \
 && install -m 0755 docker/healthcheck.py /opt/specd/bin/specd-healthcheck

FROM ubuntu:24.04
# Keep in step with the build stage's ROCm release.
ARG ROCM_VERSION=6.4.1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl gnupg \
 && install -d -m 0755 /etc/apt/keyrings \
 && curl -fsSL https://repo.radeon.com/rocm/rocm.gpg.key | gpg --dearmor -o /etc/apt/keyrings/rocm.gpg \
 && echo "deb [arch=amd64 signed-by=/etc/apt/keyrings/rocm.gpg] https://repo.radeon.com/rocm/apt/${ROCM_VERSION} noble main" \
      > /etc/apt/sources.list.d/rocm.list \
 && echo "deb [arch=amd64 signed-by=/etc/apt/keyrings/rocm.gpg] https://repo.radeon.com/amdgpu/${ROCM_VERSION}/ubuntu noble main" \
      > /etc/apt/sources.list.d/amdgpu.list \
 && printf 'Package: *\nPin: release o=repo.radeon.com\nPin-Priority: 600\n' > /etc/apt/preferences.d/rocm-pin-600 \
 && apt-get update \
 && apt-get install -y --no-install-recommends hip-runtime-amd python3 tini libstdc++6 \
 && apt-get purge -y --auto-remove curl gnupg \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 specd \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin specd \
 && install -d -o 10001 -g 10001 /data
COPY --from=build /opt/specd /opt/specd
ENV PATH=/opt/specd/bin:$PATH \
    LD_LIBRARY_PATH=/opt/rocm/lib \
    SPECD_HOME=/data \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/specd
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 CMD ["specd-healthcheck", "worker"]
ENTRYPOINT ["/usr/bin/tini", "--"]
# The container is given one GPU (ROCR_VISIBLE_DEVICES or the device plugin): index 0.
CMD ["specd", "worker", "--model", "demo", "--device", "hip:0"]
