"""Helpers shared by the test tiers and the benchmarks: processes, ports, paths, manifests, the Kubernetes
API emulator, the test cluster. Nothing here is a test; no test module imports another."""
