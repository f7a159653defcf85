"""A warm spare worker: an interpreter that has imported torch and waits to become the next attempt's rank.

``trainguard run`` starts one per rank while an attempt trains (``python -m trainer_sidecar.guardian.spare
--channel FD``), already carrying the next attempt's environment (its gang marker above all: the
runner's watchdog finds processes by the environment they were started with). The spare imports torch,
``torch.distributed``, the guardian and, for ``--preload-script``, the installed packages the script
imports at its top level (never the user's own modules beside the script or in the working directory),
writes ``READY`` and blocks on the channel. End of file means it is not needed: it exits 0; a handoff
that arrives broken exits 1 (a rank that never ran must not pass for one that finished).

Given a ``Handoff`` (``trainer_sidecar.contract.handoff``) it becomes what a cold ``python SCRIPT ARGS``
or ``python -m MODULE ARGS`` would have been: the two descriptors it received become its standard output
and standard error (what a cold worker's would have been: the runner's log for both, the launcher's own
standard output and its standard error's pipe), ``os.environ`` is replaced by the attempt's environment,
it changes into the working directory, sets ``sys.argv``, ``sys.orig_argv`` and ``sys.path[0]`` as the
interpreter does, and runs the script as ``__main__``. Exits match a cold interpreter's: the
``SystemExit`` code, or 1 with the traceback (the spare's own frames left out) for an unhandled
exception, with ``sys.last_value`` set first, as the guardian's exit hook expects (``guardian.ending``);
an unhandled KeyboardInterrupt is printed the same way and ends the interpreter by SIGINT after its exit
hooks, as a cold one does. Signals keep the interpreter's defaults (the guardian installs its SIGTERM
handler over them as in a cold worker).

Either way the script runs in a fresh ``__main__`` module that stays ``sys.modules["__main__"]`` to the
end, exit hooks included (an ``atexit`` handler may pickle the script's classes by ``__main__``):
``runpy.run_path`` and ``runpy.run_module(..., alter_sys=True)`` would put the spare's own module back
when the script returns. A script runs from its compiled source, as the interpreter runs it; a module
through ``runpy._run_module_as_main``, the function the interpreter's own ``-m`` calls (the traceback of
an exception starts in its frames, as a cold ``-m`` run's does).
"""

from __future__ import annotations

import argparse
import ast
import atexit
import builtins
import contextlib
import gc
import importlib
import importlib.machinery
import importlib.util
import io
import os
import runpy
import socket
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer_sidecar.contract.handoff import READY, Handoff, HandoffError, RunMode, receive_handoff

#: Imported by every spare: what a guarded worker imports first, and pays most of its start for (the
#: package ``trainer_sidecar.guardian`` alone would not do: ``trainer_sidecar.Guardian`` is exported lazily
#: and its module, with the checkpoint store under it, is another second and a half on a busy machine).
#: ``torch._dynamo``: every ``torch.optim`` optimizer's constructor imports it (``add_param_group`` is
#: wrapped by ``torch._disable_dynamo``, which imports it on first use); on this machine it is 0.7 s of
#: a warm restart's path, paid after the rendezvous with the whole gang waiting.
BASE_IMPORTS = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "trainer_sidecar.guardian",
    "trainer_sidecar.guardian.guardian",
)
#: A script larger than this is not parsed for its imports (it is run all the same).
_MAX_SCRIPT_BYTES = 4 << 20
# Whatever the script left (its globals, the exception that ended it) is kept here until the interpreter
# exits, as a cold interpreter keeps __main__ and the exception: the guardian's exit hook runs after the
# script and must find the objects it holds weakly.
_KEPT: list[object] = []


def main(argv: list[str] | None = None) -> None:
    """Warm up, wait for a handoff on the channel, run it (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="trainguard-spare")
    parser.add_argument("--channel", type=int, required=True, help="the socket's descriptor")
    parser.add_argument("--preload-script", default="", help="the script whose installed imports to load")
    args = parser.parse_args(argv)
    channel = socket.socket(fileno=args.channel)
    warm(args.preload_script)
    freeze_heap()
    # The runner may have sent its handoff and closed its end while the imports ran: the message still
    # waits in this end's buffer, so a failed READY says nothing and the receive below decides.
    with contextlib.suppress(OSError):
        channel.sendall(READY)
    try:
        received = receive_handoff(channel)
    except (OSError, HandoffError) as exc:
        # A handoff began and went wrong: a rank that never ran must not look like one that finished.
        print(f"trainguard spare: the handoff failed: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    if received is None:  # closed without a handoff: not needed
        print("trainguard spare: not needed", file=sys.stderr, flush=True)
        sys.exit(0)
    handoff, stdout_fd, stderr_fd = received
    channel.close()
    become(handoff, stdout_fd, stderr_fd)
    run(handoff)


def warm(preload_script: str) -> list[str]:
    """Import ``BASE_IMPORTS`` and the installed imports of ``preload_script`` ("" for none); the names
    that failed (the script will meet the same error itself, in its own log)."""
    failed = []
    for name in (*BASE_IMPORTS, *installed_imports(preload_script)):
        try:
            importlib.import_module(name)
        except Exception as exc:
            print(f"trainguard spare: preloading {name} failed: {exc!r}", file=sys.stderr, flush=True)
            failed.append(name)
    return failed


def freeze_heap() -> None:
    """Collect once, then move every object the imports made into the collector's permanent
    generation, and thaw it again at exit.

    A cold interpreter's first full collection comes long after its imports; a spare's comes during the
    handed-off run's first allocations (the checkpoint read), and walks the whole of torch's module graph:
    about half a second on the recovery's path with the gang waiting. Frozen objects are never examined
    again, which is what a long-lived import graph wants; they are still freed at exit, and the thaw lets
    the interpreter's own final collections see them as a cold interpreter's would."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


def installed_imports(script: str) -> list[str]:
    """The modules ``script`` imports at its top level (also in top-level ``if``/``try`` blocks) that it
    would find outside its own directory and the working directory: installed packages, not the user's
    code (importing that early could run it with the wrong environment). [] when it cannot be read."""
    if not script:
        return []
    path = Path(script).absolute()
    try:
        with io.open_code(str(path)) as handle:
            source = handle.read(_MAX_SCRIPT_BYTES + 1)
        if len(source) > _MAX_SCRIPT_BYTES:
            return []
        tree = ast.parse(source, str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    own = [path.resolve().parent, Path.cwd().resolve()]
    search = [str(own[0]), *sys.path[1:]]
    names = []
    for name in _top_level_imports(tree.body):
        top = name.split(".")[0]
        if top in sys.builtin_module_names or name in names:
            continue
        spec = importlib.machinery.PathFinder.find_spec(top, search)
        if spec is None or not _installed(spec, own):
            continue
        names.append(name)
    return names


def _top_level_imports(body: list[ast.stmt]) -> Iterator[str]:
    for node in body:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
        elif isinstance(node, ast.If):
            yield from _top_level_imports(node.body)
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level_imports(node.body)


def _installed(spec: importlib.machinery.ModuleSpec, own: list[Path]) -> bool:
    locations = list(spec.submodule_search_locations or []) or ([spec.origin] if spec.origin else [])
    for location in locations:
        resolved = Path(location).resolve()
        if any(resolved == d or d in resolved.parents for d in own):
            return False
    return bool(locations)


def become(handoff: Handoff, stdout_fd: int, stderr_fd: int) -> None:
    """Take on the attempt's standard output and error, environment, working directory and argv."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    for fd in {stdout_fd, stderr_fd} - {1, 2}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(handoff.environment)
    os.chdir(handoff.cwd)
    args = list(handoff.argv[1:])
    if handoff.mode is RunMode.MODULE:
        # As the interpreter runs -m: "-m" while the module is found, its file once it runs (runpy).
        sys.argv = ["-m", *args]
        sys.orig_argv = [sys.orig_argv[0], "-m", handoff.target, *args]
    else:
        sys.argv = list(handoff.argv)
        sys.orig_argv = [sys.orig_argv[0], *handoff.argv]


def run(handoff: Handoff) -> None:
    """Run the handed-off script or module as ``__main__``; end as a cold interpreter would."""
    try:
        if handoff.mode is RunMode.MODULE:
            run_module(handoff.target)
        else:
            run_script(handoff.target)
    except SystemExit as exc:
        _KEPT.append(exc)
        raise
    except KeyboardInterrupt as exc:
        _KEPT.append(exc)
        interrupted(exc)
        raise  # the interpreter ends by SIGINT after its exit hooks, as for a cold worker
    except BaseException as exc:
        _KEPT.append(exc)
        report_unhandled(exc)
        raise SystemExit(1) from None


def _fresh_main() -> types.ModuleType:
    """A new ``__main__`` module as the interpreter makes one, made ``sys.modules["__main__"]`` for good
    (the spare's own module must not come back before the exit hooks, which may pickle the script's
    classes by ``__main__``)."""
    module = types.ModuleType("__main__")
    module.__dict__.update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = module
    _KEPT.append(module)
    return module


def _set_path0(directory: str) -> None:
    """``sys.path[0]`` as the interpreter sets it, where it sets one (not under ``-P``/``PYTHONSAFEPATH``,
    which the spare, started with the attempt's environment, shares)."""
    if not sys.flags.safe_path:
        sys.path[0] = directory


def run_module(target: str) -> None:
    """Run the module ``target`` as ``python -m target`` does: through the very function the interpreter
    calls (``runpy._run_module_as_main``: ``__spec__``, ``__file__``, ``sys.argv[0]`` the module's file,
    the package imported first), in a fresh ``__main__``, with the working directory as ``sys.path[0]``."""
    _set_path0(os.getcwd())
    _fresh_main()
    run_as_main = getattr(runpy, "_run_module_as_main")  # noqa: B009 - private, but what -m itself runs
    run_as_main(target, alter_argv=True)


def run_script(target: str) -> None:
    """Run the script ``target`` (relative to the working directory) as the interpreter runs
    ``python target``: ``__file__`` absolute, ``sys.path[0]`` its real directory, a new ``__main__``."""
    path = os.path.abspath(target)
    try:
        with io.open_code(path) as handle:
            source = handle.read()
    except OSError as exc:
        reason = f"[Errno {exc.errno}] {exc.strerror}"
        print(f"{sys.executable}: can't open file {path!r}: {reason}", file=sys.stderr)
        raise SystemExit(2) from None
    _set_path0(os.path.dirname(os.path.realpath(path)))
    namespace: dict[str, Any] = _fresh_main().__dict__
    namespace.update(
        __file__=path,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
    )
    code = compile(source, path, "exec", dont_inherit=True)
    exec(code, namespace)


def _without_own_frames(exc: BaseException) -> types.TracebackType | None:
    """``exc``'s traceback from its first frame that is not the spare's (a cold ``-m`` run's traceback
    starts in runpy, a script's in the script: what is left after the spare's frames, either way)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _set_last(exc: BaseException, tb: types.TracebackType | None) -> None:
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = exc


def report_unhandled(exc: BaseException) -> None:
    """Print ``exc`` as the interpreter prints an unhandled exception, the spare's own frames left out,
    after setting ``sys.last_*`` as it does."""
    tb = _without_own_frames(exc)
    exc = exc.with_traceback(tb)
    _set_last(exc, tb)
    sys.excepthook(type(exc), exc, tb)


def interrupted(exc: KeyboardInterrupt) -> None:
    """Print a KeyboardInterrupt that ends the script as the interpreter would, then let it go on out.

    A cold interpreter prints it through ``sys.excepthook`` (``sys.last_*`` set), runs its exit hooks,
    and kills itself with SIGINT; the spare lets the interpreter do the last two by raising it again.
    The interpreter prints it once more, with the spare's frames added back on the way out: the hook it
    calls for that is swapped for one that prints nothing and puts ``sys.last_*``, the exception's
    traceback and ``sys.excepthook`` back as they were after the first print.
    """
    report_unhandled(exc)
    tb, hook = sys.last_traceback, sys.excepthook

    def restore(kind: type[BaseException], value: BaseException, _: types.TracebackType | None) -> None:
        value.with_traceback(tb)
        _set_last(value, tb)
        sys.excepthook = hook

    sys.excepthook = restore


if __name__ == "__main__":
    main()
