"""Run ``ENV.py --help`` and ``ENV.py process --help`` for each env file given, in one
process (importing transformers and datasets once); prints one JSON line per call."""

import contextlib
import io
import json
import runpy
import sys

for path in sys.argv[1:]:
    for args in (["--help"], ["process", "--help"]):
        out = io.StringIO()
        code: object = 0
        sys.argv = [path, *args]
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            code = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"file": path, "args": args, "code": code, "out": out.getvalue()}))
