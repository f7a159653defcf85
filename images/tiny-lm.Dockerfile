# The examples' worker image: a worker image (images/worker.Dockerfile: a PyTorch image plus the guardian
# library) with examples/tiny_lm and examples/04_fsdp on top. Build it from the repository root:
#
#   docker build -f images/tiny-lm.Dockerfile --build-arg WORKER_IMAGE=REGISTRY/my-worker:0.1.0 \
#     -t REGISTRY/tiny-lm:0.1.0 .
#
# examples/k8s/job.yaml runs `python examples/tiny_lm/train.py` in /app as user 1000;
# examples/04_fsdp/job.yaml runs `python examples/04_fsdp/fsdp_lm.py` there.
ARG WORKER_IMAGE
FROM ${WORKER_IMAGE}
COPY examples/tiny_lm/ /app/examples/tiny_lm/
COPY examples/04_fsdp/ /app/examples/04_fsdp/
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1
USER 1000:1000
