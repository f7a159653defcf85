# A stand-in for "your PyTorch image", for the tests on a machine with no image registry (scripts/images.sh
# builds it): BASE (a Debian base with Python 3.11, made locally) plus torch as `pip install torch` at the
# version requirements.lock pins installs it, with the CUDA libraries it requires, copied from the
# project's own environment (scripts/images.sh stages them in site-packages/). Measured: the PyPI build
# of torch does not even import without them on a machine with no GPU ("libcublasLt.so.*[0-9] not
# found"), and maps 2.8 GB of them while it trains on the CPU, so none is left out. The staged files
# carry no byte code; like pip at install, the image compiles it (all but the one file of torch's tests
# written in Python 3.12 syntax, which pip too leaves uncompiled). Without it a worker that cannot write
# its image (a non-root user) compiles every module it imports past `import torch` at every start: 865
# modules (torch.distributed, torch._dynamo, sympy...), 4.1 s against 1.1 s of a start measured here.
ARG BASE
FROM ${BASE}
RUN python3 -m venv /opt/pytorch
COPY site-packages/ /opt/pytorch/lib/python3.11/site-packages/
RUN /opt/pytorch/bin/python -m compileall -qq -j 0 -x '/torch/testing/_internal/py312_intrinsics\.py$' \
    /opt/pytorch/lib/python3.11/site-packages
ENV PATH=/opt/pytorch/bin:$PATH
