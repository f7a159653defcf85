"""Tensor helpers the guardian and the checkpoint package share: finiteness, sharding, state, RNG.

Imports torch and the contract only.
"""
