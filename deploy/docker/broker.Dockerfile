# The broker image: the base install and PostgreSQL's driver (`deltamesh[broker]`: no torch,
# transformers or matplotlib). Build from the repository root:
#   docker build -f deploy/docker/broker.Dockerfile -t deltamesh-broker .
# Runs as an unprivileged user; its SQLite database is on a volume; config, keys and secrets are mounted
# (deploy/kubernetes/broker.yaml).
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
RUN pip install --no-cache-dir "$(ls /wheels/deltamesh-*.whl)[broker]" && rm -rf /wheels \
    && useradd --system --uid 10001 --home-dir /var/lib/deltamesh --create-home deltamesh
USER 10001
WORKDIR /var/lib/deltamesh
VOLUME /var/lib/deltamesh
EXPOSE 8800
STOPSIGNAL SIGTERM
ENTRYPOINT ["deltamesh"]
CMD ["broker", "--config", "/etc/deltamesh/broker.toml"]
