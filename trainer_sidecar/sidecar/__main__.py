"""``python -m trainer_sidecar.sidecar``: the sidecar process (same as ``trainguard-sidecar``)."""

from trainer_sidecar.sidecar.server import main

raise SystemExit(main())
