# The trainguard image: the operator (trainguard-operator) and the sidecar (trainguard-sidecar), without
# torch. Build it from the repository root, with the project's wheel in dist/:
#
#   python -m pip wheel --no-deps --wheel-dir dist .
#   docker build -f images/trainguard.Dockerfile -t REGISTRY/trainguard:0.1.0 .
#
# BASE is any image with Python 3.11 or later and its venv module: the default is the public
# python:3.11-slim; scripts/images.sh builds it from a Debian base made locally (no registry is needed).
# The dependencies are those the operator and sidecar import (images/trainguard-requirements.txt),
# pinned by requirements.lock; the wheel itself is installed without its dependencies, which include
# torch for the guardian library. scripts/images.sh, which has no index inside the build, mounts a
# directory of wheels and a pip.conf pointing at it.
ARG BASE=python:3.11-slim
FROM ${BASE}
COPY requirements.lock images/trainguard-requirements.txt /tmp/trainguard-build/
COPY dist/trainguard-*.whl /tmp/trainguard-build/
# One layer: the build files go in the same step that used them.
RUN python3 -m venv /opt/trainguard \
    && /opt/trainguard/bin/pip install --no-cache-dir --disable-pip-version-check --quiet \
        -r /tmp/trainguard-build/trainguard-requirements.txt -c /tmp/trainguard-build/requirements.lock \
    && /opt/trainguard/bin/pip install --no-cache-dir --disable-pip-version-check --quiet --no-deps \
        /tmp/trainguard-build/trainguard-*.whl \
    && /opt/trainguard/bin/pip uninstall --yes --quiet pip setuptools \
    && rm -rf /tmp/trainguard-build
# A numeric user (65532, no passwd entry needed), so the kubelet can verify runAsNonRoot; nothing is
# written to the image at run time, so it runs under readOnlyRootFilesystem.
ENV PATH=/opt/trainguard/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 65532:65532
ENTRYPOINT ["trainguard-operator"]
