# A worker image: your PyTorch image plus trainguard's guardian library. Build it from the repository
# root, with the project's wheel in dist/:
#
#   python -m pip wheel --no-deps --wheel-dir dist .
#   docker build -f images/worker.Dockerfile --build-arg PYTORCH_IMAGE=YOUR_PYTORCH_IMAGE \
#     -t REGISTRY/my-worker:0.1.0 .
#
# PYTORCH_IMAGE is the image your training already runs in: it brings Python, torch (the CUDA build on a
# GPU cluster) and your own dependencies, and its `python` must be the interpreter torch is installed
# in. The wheel goes in without its dependencies, so your torch is kept as it is; the guardian library
# adds only what images/worker-requirements.txt lists, pinned by requirements.lock. Then copy your
# training code on top and set the user it runs as (images/tiny-lm.Dockerfile does both for
# examples/tiny_lm). The install runs as PYTORCH_IMAGE's user, which must be able to install into its
# Python (root, in the usual PyTorch images).
ARG PYTORCH_IMAGE
FROM ${PYTORCH_IMAGE}
COPY requirements.lock images/worker-requirements.txt /tmp/trainguard-build/
COPY dist/trainguard-*.whl /tmp/trainguard-build/
RUN python -c "import torch" \
    && python -m pip install --no-cache-dir --disable-pip-version-check --quiet \
        -r /tmp/trainguard-build/worker-requirements.txt -c /tmp/trainguard-build/requirements.lock \
    && python -m pip install --no-cache-dir --disable-pip-version-check --quiet --no-deps \
        /tmp/trainguard-build/trainguard-*.whl \
    && rm -rf /tmp/trainguard-build
ENV PYTHONUNBUFFERED=1
