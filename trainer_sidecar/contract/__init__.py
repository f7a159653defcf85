"""The contract between the processes: what the worker, the sidecar and both runners agree on.

Torch-free and dependency-light: exit codes, the bounded file reader, the guardian's settings, the
worker's status payload and a job's identity. Every other package may import it; it imports none of them.
"""
