"""Run ``ENV.py check ARGS...`` for each ``{"file", "args"}`` JSON object given on stdin, in one
process (torch, transformers and datasets are imported once), each from its own folder; prints
one JSON line per env: its exit code, output and time taken."""

import contextlib
import io
import json
import os
import runpy
import sys
import time

for line in sys.stdin:
    if not line.strip():
        continue
    job = json.loads(line)
    path = os.path.abspath(job["file"])
    out = io.StringIO()
    code: object = 0
    sys.argv = [path, "check", *job["args"]]
    cwd = os.getcwd()
    os.chdir(os.path.dirname(path))
    sys.path.insert(0, os.path.dirname(path))
    started = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        code = f"{type(exc).__name__}: {exc}"
    finally:
        os.chdir(cwd)
        sys.path.remove(os.path.dirname(path))
    seconds = round(time.monotonic() - started, 1)
    result = {"file": job["file"], "code": code, "out": out.getvalue(), "seconds": seconds}
    print(json.dumps(result), flush=True)
