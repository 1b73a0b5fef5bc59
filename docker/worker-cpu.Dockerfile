# syntax=docker/dockerfile:1
# specd CPU worker image: `specd worker --device cpu`, the engine built with SPECD_BACKEND=cpu
# (the wheel the test suite builds: AVX2/FMA/F16C kernels picked at run time, never
# -march=native, so the image runs on any x86-64). No model inside: the worker reads
# $SPECD_HOME=/data (a volume), and `--model demo` pulls the demo GGUF there if absent.
#
#   docker build -f docker/worker-cpu.Dockerfile -t specd/worker-cpu .   (from the repo root)

FROM python:3.12-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY worker/ worker/
COPY gateway/ gateway/
COPY docker/healthcheck.py docker/
# cmake and ninja come from PyPI through scikit-build-core's build requirements
ENV SPECD_BACKEND=cpu PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/specd \
 && /opt/specd/bin/pip wheel --no-cache-dir --no-deps -w /tmp/wheels . \
 && /opt/specd/bin/pip install --no-cache-dir /tmp/wheels/specd-*.whl \
 && install -m 0755 docker/healthcheck.py /opt/specd/bin/specd-healthcheck

FROM python:3.12-slim-bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini libstdc++6 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 specd \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin specd \
 && install -d -o 10001 -g 10001 /data
COPY --from=build /opt/specd /opt/specd
ENV PATH=/opt/specd/bin:$PATH \
    SPECD_HOME=/data \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/specd
# healthy once this container's worker heartbeat is in Redis (model loaded, serving)
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 CMD ["specd-healthcheck", "worker"]
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["specd", "worker", "--model", "demo", "--device", "cpu"]
