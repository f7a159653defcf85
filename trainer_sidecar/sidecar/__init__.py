"""The sidecar process: reads the worker's status, serves its liveness probe and its metrics.

Torch-free by rule (checked by import-linter): it imports the contract only.
"""
