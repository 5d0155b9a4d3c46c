# The gateway image: the base install only (`deltamesh[gateway]`: no torch, transformers or
# matplotlib). Build from the repository root:
#   docker build -f deploy/docker/gateway.Dockerfile -t deltamesh-gateway .
# Runs as an unprivileged user; the store is a volume; config, keys and secrets are mounted
# (deploy/kubernetes/gateway.yaml).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY deltamesh deltamesh
COPY delta delta
COPY gateway gateway
COPY trainer trainer
COPY mesh mesh
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/deltamesh-*.whl)[gateway]" && rm -rf /wheels \
    && useradd --system --uid 10001 --home-dir /var/lib/deltamesh --create-home deltamesh
USER 10001
WORKDIR /var/lib/deltamesh
VOLUME /var/lib/deltamesh
EXPOSE 8700
STOPSIGNAL SIGTERM
ENTRYPOINT ["deltamesh"]
CMD ["gateway", "--config", "/etc/deltamesh/gateway.toml"]
