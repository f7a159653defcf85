"""``trainguard run``: the local runner that plays the operator's part on one machine."""
