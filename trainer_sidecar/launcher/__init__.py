"""The worker container's entrypoint for restarts in place (``trainguard-launch``); torch-free."""
