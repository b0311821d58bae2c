"""A tiny Chrome DevTools Protocol client for driving headless Chromium in tests.

Launches ``chromium --headless --remote-debugging-port=0``, attaches to its first page over the
websocket it announces on stderr, and records JavaScript exceptions, console errors and
browser log errors (CSP violations included) while the test drives the page.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary on PATH, or ``None``."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with one page attached over CDP."""

    def __init__(self, binary: str, timeout: float = 30.0) -> None:
        from websockets.sync.client import connect

        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="atropos-chromium-")
        self._stack = contextlib.ExitStack()
        self._proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            port = self._wait_for_port()
            page_ws = self._page_websocket(port)
            self._ws = self._stack.enter_context(
                connect(page_ws, max_size=None, open_timeout=timeout)
            )
        except BaseException:
            self.close()
            raise
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self.send("Runtime.enable")
        self.send("Log.enable")
        self.send("Page.enable")

    def _wait_for_port(self) -> int:
        assert self._proc.stderr is not None
        found: list[int] = []
        lines: list[str] = []

        def reader() -> None:
            assert self._proc.stderr is not None
            for line in self._proc.stderr:
                lines.append(line)
                match = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
                if match and not found:
                    found.append(int(match.group(1)))
            # Keep draining until the process exits so it never blocks on a full pipe.

        threading.Thread(target=reader, daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while not found:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not start:\n" + "".join(lines[-20:]))
            time.sleep(0.05)
        return found[0]

    def _page_websocket(self, port: int) -> str:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                    targets = json.load(r)
                pages = [t for t in targets if t.get("type") == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("chromium exposed no page target")
            time.sleep(0.05)

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Call a CDP method and return its result; events seen meanwhile go to ``events``."""
        self._next_id += 1
        msg_id = self._next_id
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no answer to {method}")
            message = json.loads(self._ws.recv(timeout=remaining))
            if message.get("id") == msg_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            if "method" in message:
                self.events.append(message)

    def wait_for_event(self, method: str) -> dict[str, Any]:
        """Block until an event named ``method`` arrives (or was already recorded)."""
        for event in self.events:
            if event["method"] == method:
                return event
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no {method} event")
            message = json.loads(self._ws.recv(timeout=remaining))
            if "method" in message:
                self.events.append(message)
                if message["method"] == method:
                    return message

    def navigate(self, path: Path) -> None:
        """Load a local file and wait for its load event."""
        self.events.clear()
        self.send("Page.navigate", url=path.resolve().as_uri())
        self.wait_for_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def press(self, key: str) -> None:
        """Press and release one key (``"j"``, ``"ArrowDown"``, ``"Enter"`` ...)."""
        special = {
            "ArrowDown": 40,
            "ArrowUp": 38,
            "ArrowLeft": 37,
            "ArrowRight": 39,
            "Enter": 13,
        }
        if key in special:
            down: dict[str, Any] = {"key": key, "code": key, "windowsVirtualKeyCode": special[key]}
            if key == "Enter":
                down["text"] = "\r"
        else:
            down = {
                "key": key,
                "code": f"Key{key.upper()}",
                "text": key,
                "windowsVirtualKeyCode": ord(key.upper()),
            }
        self.send("Input.dispatchKeyEvent", type="keyDown", **down)
        up = {k: v for k, v in down.items() if k != "text"}
        self.send("Input.dispatchKeyEvent", type="keyUp", **up)

    def errors(self) -> list[str]:
        """JavaScript exceptions, console errors and browser log errors seen since navigation."""
        found = []
        for event in self.events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(json.dumps(params.get("exceptionDetails", {}))[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(json.dumps(params.get("args", []))[:500])
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                found.append(params["entry"].get("text", "")[:500])
        return found

    def close(self) -> None:
        """Shut the browser down and remove its profile."""
        try:
            self._stack.close()
        except Exception:  # noqa: BLE001 - best effort on teardown
            pass
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        shutil.rmtree(self._profile, ignore_errors=True)
