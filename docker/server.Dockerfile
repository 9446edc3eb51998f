# The specsplit server: torch + transformers, CPU by default.
# TORCH_INDEX_URL may name a PyTorch wheel index (for example the CPU-only one) to keep
# the image small; by default torch comes from the ordinary package index.
FROM python:3.11-slim
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 SPECSPLIT_CACHE=/models
WORKDIR /src
# A C compiler: on a GPU, serve compiles the target's norms and MLPs (--fuse, on by default
# there), and Triton builds its launchers with one; without it serve falls back, unfused.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install --no-cache-dir "torch==${TORCH_VERSION}"; \
    fi
COPY shared /src/shared
COPY server /src/server
RUN pip install --no-cache-dir /src/shared /src/server
EXPOSE 50051
CMD ["specsplit-server", "--help"]
