# A stand-in for "your PyTorch image", for the tests on a machine with no image registry (scripts/images.sh
# builds it): BASE (a Debian base with Python 3.11, made locally) plus torch as `pip install torch` at the
# version requirements.lock pins installs it, with the CUDA libraries it requires, copied from the
# project's own environment (scripts/images.sh stages them in site-packages/). Measured: the PyPI build
# of torch does not even import without them on a machine with no GPU ("libcublasLt.so.*[0-9] not
# found"), and maps 2.8 GB of them while it trains on the CPU, so none is left out.
ARG BASE
FROM ${BASE}
RUN python3 -m venv /opt/pytorch
COPY site-packages/ /opt/pytorch/lib/python3.11/site-packages/
ENV PATH=/opt/pytorch/bin:$PATH
