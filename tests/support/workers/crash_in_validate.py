"""Run a loop script with its ``validate`` SIGKILLing the process the first time it is called.

    python crash_in_validate.py MARKER SCRIPT [SCRIPT's arguments]

The script (``examples/06_imagenet_style/imagenet.py``) is imported as a module and its module-level
``validate`` replaced before its ``main()`` runs, so the kill lands inside the loop's own evaluation,
right after an epoch's data ran out. MARKER is created just before the kill: a second run with the same
marker validates normally, as a restarted job would.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    """Patch the script's ``validate``, then run its ``main`` with its own arguments."""
    marker, script = Path(sys.argv[1]), Path(sys.argv[2])
    sys.argv = [str(script), *sys.argv[3:]]
    sys.path.insert(0, str(script.parent))
    module = importlib.import_module(script.stem)
    validate = module.validate

    def crashing_validate(*args: Any, **kwargs: Any) -> Any:
        if not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return validate(*args, **kwargs)

    setattr(module, "validate", crashing_validate)  # noqa: B010 (a module mypy cannot see)
    module.main()


if __name__ == "__main__":
    main()
