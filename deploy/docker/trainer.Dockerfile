# The trainer image: deltamesh with its ML stack (`deltamesh[trainer]`: torch, transformers).
# torch comes first from TORCH_INDEX (the CPU build by default; a CUDA host builds with
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128). Build from the repository root:
#   docker build -f deploy/docker/trainer.Dockerfile -t deltamesh-trainer .
# The pool image is the same with ROLE=pool (pool.Dockerfile).
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
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG ROLE=trainer
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==2.13.0" \
    && pip install --no-cache-dir "$(ls /wheels/deltamesh-*.whl)[$ROLE]" && rm -rf /wheels \
    && useradd --system --uid 10001 --home-dir /var/lib/deltamesh --create-home deltamesh
USER 10001
ENV HF_HOME=/var/lib/deltamesh/hf
WORKDIR /var/lib/deltamesh
STOPSIGNAL SIGTERM
ENTRYPOINT ["deltamesh"]
CMD ["train", "--config", "/etc/deltamesh/secrets/trainer.toml"]
