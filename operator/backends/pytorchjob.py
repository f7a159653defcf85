"""The Kubeflow training operator's PyTorchJob (``kubeflow.org/v1``) as a backend. Pure.

The manifest itself is ``render.render_pytorchjob`` (the module docstring there says what it holds)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainguard_operator.backends import ChildState, RenderRequest, state_by_conditions
from trainguard_operator.render import (
    PYTORCHJOB_GROUP,
    PYTORCHJOB_KIND,
    PYTORCHJOB_NAME_LABEL,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    pytorchjob_name,
    render_pytorchjob,
    rendered_world,
)


class PyTorchJobBackend:
    """An attempt as a Workers-only PyTorchJob."""

    kind = PYTORCHJOB_KIND
    group = PYTORCHJOB_GROUP
    version = PYTORCHJOB_VERSION
    plural = PYTORCHJOB_PLURAL
    needs = "the Kubeflow training operator"
    pod_owner_label = PYTORCHJOB_NAME_LABEL
    status_field = "pytorch_job"
    restart_way = "new_pytorchjob"

    @property
    def api_version(self) -> str:
        """``kubeflow.org/v1``."""
        return f"{self.group}/{self.version}"

    def child_name(self, job_name: str, attempt: int) -> str:
        """``render.pytorchjob_name``."""
        return pytorchjob_name(job_name, attempt)

    def render(self, request: RenderRequest) -> dict[str, Any]:
        """``render.render_pytorchjob`` of the request."""
        return render_pytorchjob(
            request.job,
            request.owner,
            request.attempt,
            request.remediation,
            request.settings,
            checkpoint_seconds=request.checkpoint_seconds,
            history=request.history,
            avoid_node=request.avoid_node,
        )

    def rendered_world(self, child: Mapping[str, Any]) -> dict[str, int] | None:
        """``render.rendered_world``."""
        return rendered_world(child)

    def state(self, child: Mapping[str, Any]) -> ChildState:
        """Succeeded or Failed by the training operator's True condition of that type."""
        return state_by_conditions(child, "Succeeded")


PYTORCHJOB = PyTorchJobBackend()
