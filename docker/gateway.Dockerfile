# syntax=docker/dockerfile:1
# specd gateway image: the OpenAI-compatible HTTP edge (`specd gateway`, port 8000) and the
# model fetcher (`specd models pull`, which fills the model volume for the workers). No
# native engine: the wheel is built with SPECD_BACKEND=none and installed with only the
# packages docker/gateway_deps.py picks from pyproject.toml (no numpy, gguf, tokenizers).
#
#   docker build -f docker/gateway.Dockerfile -t specd/gateway .      (from the repo root)

FROM python:3.12-slim-bookworm AS build
# CMake's project() probes for a C++ compiler even when SPECD_BACKEND=none builds nothing.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY worker/ worker/
COPY gateway/ gateway/
COPY docker/gateway_deps.py docker/healthcheck.py docker/
ENV SPECD_BACKEND=none PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/specd \
 && python docker/gateway_deps.py pyproject.toml > /tmp/gateway-requirements.txt \
 && /opt/specd/bin/pip install --no-cache-dir -r /tmp/gateway-requirements.txt \
 && /opt/specd/bin/pip wheel --no-cache-dir --no-deps -w /tmp/wheels . \
 && /opt/specd/bin/pip install --no-cache-dir --no-deps /tmp/wheels/specd-*.whl \
 && install -m 0755 docker/healthcheck.py /opt/specd/bin/specd-healthcheck

FROM python:3.12-slim-bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 specd \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin specd \
 && install -d -o 10001 -g 10001 /data
COPY --from=build /opt/specd /opt/specd
# SPECD_HOME=/data: `specd models pull` writes /data/models/<file>.gguf (mount a volume there)
ENV PATH=/opt/specd/bin:$PATH \
    SPECD_HOME=/data \
    SPECD_HOST=0.0.0.0 \
    SPECD_PORT=8000 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/specd
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 CMD ["specd-healthcheck", "gateway"]
# tini: PID 1 that forwards SIGTERM (graceful stop) and reaps children (pip in models pull)
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["specd", "gateway"]
