"""The trainguard operator: GuardedTrainingJob to PyTorchJob, whole-gang recovery, status and metrics.

This folder imports as ``trainguard_operator`` (see pyproject.toml): a package named ``operator`` would
shadow Python's standard library module.
"""
