"""The contract between the processes: what the worker, the sidecar and both runners agree on.

Torch-free and dependency-light: exit codes, the bounded file reader, the guardian's settings and the
worker's status payload. Every other package may import it; it imports none of them.
"""
