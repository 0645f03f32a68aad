# kvcm server image: `docker build -t kvcm:0.1.0 .` then
#   docker run -p 50051:50051 -p 8080:8080 kvcm:0.1.0
# gRPC on 50051, HTTP (/metrics, /healthz, /readyz, /v1/pools) on 8080, both on all interfaces.
# The server's own defaults bind 127.0.0.1; in a container that would be unreachable, so the
# CMD below binds 0.0.0.0 on the same ports.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only what the package needs: the four source roots and the pinned constraints.
COPY pyproject.toml README.md ./
COPY requirements/ requirements/
COPY proto/ proto/
COPY server/ server/
COPY core/ core/
COPY client/ client/
# The lookup's key index is a C extension (kvcm.core._lookup_index, docs/lookup.md): the
# compiler is in this stage only; the final image gets the built module inside /opt/kvcm.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# The server only: no worker (torch) or dev extras. The constraints pin every version CI tests.
RUN python -m venv /opt/kvcm \
 && /opt/kvcm/bin/pip install -c requirements/constraints.txt ".[server]" \
 && /opt/kvcm/bin/python -c "import kvcm.core._lookup_index" \
 && /opt/kvcm/bin/kvcm --help >/dev/null

FROM python:3.11-slim
LABEL org.opencontainers.image.title="kvcm" \
      org.opencontainers.image.description="A standalone KV-cache manager service with vLLM 0.33 V1 semantics" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvcm \
 && useradd --system --uid 10001 --gid kvcm --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin kvcm
COPY --from=build /opt/kvcm /opt/kvcm
ENV PATH=/opt/kvcm/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 50051 8080
# slim has no curl: the interpreter the server runs on checks liveness itself.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["kvcm", "serve"]
CMD ["--grpc-address", "0.0.0.0:50051", "--http-address", "0.0.0.0:8080"]
