"""``python -m trainguard_operator``: run the operator (kopf) with trainguard's handlers.

Scope: ``--namespace NS`` (repeatable) or ``--all-namespaces``; without either, the namespaces in
``TRAINGUARD_OPERATOR_NAMESPACES``, or cluster-wide when that is empty too. Peering: standalone unless
``--peering NAME`` is given (needs kopf's KopfPeering CRDs; then one replica is active at a time and the
others wait). kopf's liveness endpoint is served at ``--liveness`` (default ``http://0.0.0.0:8081/healthz``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import kopf
from trainguard_operator import handlers
from trainguard_operator.settings import OperatorSettings, OperatorSettingsError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainguard-operator",
        description="Run the trainguard operator: GuardedTrainingJobs to PyTorchJobs, whole-gang recovery.",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="namespace to serve (repeatable)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace")
    parser.add_argument(
        "--liveness", default="http://0.0.0.0:8081/healthz", help="kopf's liveness endpoint ('' turns it off)"
    )
    parser.add_argument("--peering", default=None, help="kopf peering object name (default: standalone)")
    parser.add_argument("--priority", type=int, default=0, help="peering priority of this replica")
    parser.add_argument("--metrics-port", type=int, default=None, help="metrics port (env ..._METRICS_PORT)")
    parser.add_argument("--metrics-host", default=None, help="metrics address (env ..._METRICS_HOST)")
    parser.add_argument("--sidecar-image", default=None, help="sidecar image (env ..._SIDECAR_IMAGE)")
    parser.add_argument("--verbose", action="store_true", help="log kopf's and the operator's details")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, load the settings, and run kopf until SIGTERM/SIGINT. Bad settings return 2."""
    args = _parser().parse_args(argv)
    overrides = {
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "sidecar_image": args.sidecar_image,
    }
    if args.namespace:
        overrides["namespaces"] = args.namespace
    try:
        settings = OperatorSettings.from_env(overrides=overrides)
    except OperatorSettingsError as exc:
        print(f"trainguard-operator: invalid setting (flag or environment):\n{exc}", file=sys.stderr)
        return 2
    clusterwide = args.all_namespaces or not settings.namespaces
    if clusterwide:  # the operator's own watches serve what kopf serves
        settings = settings.model_copy(update={"namespaces": []})
    kopf.configure(verbose=args.verbose)
    kopf.run(
        clusterwide=clusterwide,
        namespaces=() if clusterwide else settings.namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo({handlers.SETTINGS_KEY: settings}),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
