"""trainguard's tests, in three tiers: ``unit`` (in-process, fast), ``integration`` (real processes, loopback
servers, multi-process gloo, the kmock API emulator) and ``e2e`` (real Kubernetes components, helm and
Prometheus tools). Helpers shared by tests and benchmarks live in ``tests.support``."""
