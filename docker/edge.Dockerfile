# The specsplit edge: a slim image with ONNX Runtime and gRPC only, no torch and no
# transformers. Builds for linux/amd64 and linux/arm64 (Raspberry Pi, Jetson):
#   docker buildx build --platform linux/arm64 -t specsplit-edge --load -f docker/edge.Dockerfile .
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1
WORKDIR /src
COPY shared /src/shared
COPY edge /src/edge
RUN pip install --no-cache-dir /src/shared /src/edge
CMD ["specsplit-edge", "--help"]
