"""``view-run``: the group rendering, and the Gradio page in a real headless Chromium against a
real ``run-api`` fed with real tokenized groups (and a ``process`` file with no server)."""

from __future__ import annotations

import base64
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from atroposlib.frontend.run_viewer import image_data_urls, read_groups_file, render_group
from tests.conftest import REPO, free_port
from tests.frontend.chromium import Browser, find_chromium

CHROMIUM = find_chromium()
PNG_1PX = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


@functools.cache
def _tokenizer() -> tuple[Path, Any]:
    from transformers import AutoTokenizer

    from atroposlib.inference.models import smollm2_tokenizer_dir

    path = smollm2_tokenizer_dir()
    return path, AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def chat_group(question: str, answers: list[str], scores: list[float], messages: bool) -> dict:
    """A real tokenized group (SmolLM2 chat template, prompt masked)."""
    from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

    tok = _tokenizer()[1]
    group: dict[str, Any] = {"tokens": [], "masks": [], "scores": scores}
    chats = []
    for answer in answers:
        chat = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out = tokenize_for_trainer(tok, chat)
        group["tokens"].append(out["tokens"])
        group["masks"].append(out["masks"])
        chats.append(chat)
    if messages:
        group["messages"] = chats
    return group


# ----------------------------------------------------------------------------- rendering


def test_render_group_escapes_and_shows_every_completion() -> None:
    tok = _tokenizer()[1]
    group = chat_group("Say <b>hi</b>", ["<script>x()</script>", "hello"], [1.0, -0.5], False)
    page = render_group(group, tok, "Batch 1 · group 1 of 1")
    assert "<script>" not in page and "&lt;script&gt;x()&lt;/script&gt;" in page
    assert "Say &lt;b&gt;hi&lt;/b&gt;" in page
    assert "Completion 1 · Score: 1.0" in page and "Completion 2 · Score: -0.5" in page
    assert page.count("av-completion") == 2
    assert "av-tokens" not in page
    with_tokens = render_group(group, tok, "t", show_tokens=True)
    trained = sum(m != -100 for m in group["masks"][1])
    assert f"tokens: {trained} of {len(group['tokens'][1])} trained" in with_tokens
    # chat groups: the shared question once as the prompt, each reply under its score
    chat = chat_group("2+2?", ["4", "5"], [1.0, 0.0], True)
    page = render_group(chat, None, "t")
    assert page.count("2+2?") == 1 and "av-role-assistant" in page and "av-zero" in page


def test_images_and_files(tmp_path: Path) -> None:
    url = f"data:image/png;base64,{PNG_1PX}"
    assert image_data_urls([PNG_1PX, [url], "not an image", {"url": "http://x/y.png"}]) == [
        url,
        url,
    ]
    group = {"messages": ["text only"], "scores": [0.5], "images": [PNG_1PX]}
    assert f'src="{url}"' in render_group(group, None, "t")
    multimodal = {
        "scores": [1.0],
        "messages": [
            [
                {"role": "user", "content": [{"type": "text", "text": "what?"},
                                             {"type": "image_url", "image_url": {"url": url}}]},
                {"role": "assistant", "content": "a dot"},
            ]
        ],
    }  # fmt: skip
    page = render_group(multimodal, None, "t")
    assert f'src="{url}"' in page and "what?" in page
    path = tmp_path / "groups.jsonl"
    path.write_text(json.dumps(group) + "\nnot json\n" + json.dumps({"other": 1}) + "\n")
    assert read_groups_file(path) == [group]


# ----------------------------------------------------------------------------- the page


class ViewRun:
    """``python -m atroposlib.cli.view_run`` on a free port; killed on stop."""

    def __init__(self, *args: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.log_path = log
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
        env["PYTHONPATH"] = str(REPO)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "atroposlib.cli.view_run", "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(REPO),
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"view-run exited:\n{log.read_text()}")
            try:
                if httpx.get(self.url, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"view-run did not serve in time:\n{log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed")
    pytest.importorskip("websockets", reason="websockets is needed to drive chromium")
    pytest.importorskip("gradio", reason="gradio (the examples extra) is not installed")
    b = Browser(CHROMIUM, timeout=60)
    try:
        yield b
    finally:
        b.close()


def open_page(browser: Browser, url: str) -> None:
    browser.events.clear()
    browser.send("Page.navigate", url=url)
    browser.wait_for_event("Page.loadEventFired")
    wait_for(browser, "document.querySelector('#av-view') !== null", "the page to render")


def wait_for(browser: Browser, expression: str, what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = browser.evaluate(expression)
        if value:
            return value
        time.sleep(0.2)
    text = browser.evaluate("document.body ? document.body.innerText.slice(0, 3000) : ''")
    raise AssertionError(f"timed out waiting for {what}; page text:\n{text}")


def view_text(browser: Browser) -> str:
    return browser.evaluate("document.querySelector('#av-view').innerText")


def screenshot(browser: Browser, path: Path) -> None:
    data = browser.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
    path.write_bytes(base64.b64decode(data["data"]))
    print(f"\nview-run screenshot: {path}")


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
@pytest.mark.slow
def test_grab_next_batch_in_a_real_browser(browser: Browser, start_api, tmp_path: Path) -> None:
    api = start_api()
    tok_dir = _tokenizer()[0]
    app = ViewRun(
        "--api-url", api.url, "--tokenizer", str(tok_dir), "--group-size", "2",
        "--batch-wait", "20", log=tmp_path / "view-run.log",
    )  # fmt: skip
    try:
        info = httpx.get(api.url + "/info").json()
        assert info["batch_size"] == 16, "view-run registered as the trainer"
        # one batch = 8 groups of 2: a token-only group first, then chat groups
        groups = [chat_group("What is 2 + 3?", ["5", "It is six"], [1.0, -0.5], False)]
        groups += [
            chat_group(f"What is {i} + 1?", [str(i + 1), "no idea"], [1.0, 0.0], True)
            for i in range(7)
        ]
        for group in groups:
            assert httpx.post(api.url + "/scored_data", json=group).status_code == 200
        browser.send("Emulation.setDeviceMetricsOverride", width=1200, height=1400,
                     deviceScaleFactor=1, mobile=False)  # fmt: skip
        open_page(browser, app.url)
        wait_for(browser, "/Queue: 8 groups/.test(document.body.innerText)", "the queue counter")
        browser.evaluate("document.querySelector('#av-grab').click()")
        wait_for(browser, "/Score: 1.0/.test(document.querySelector('#av-view').innerText)",
                 "the first group")  # fmt: skip
        text = view_text(browser)
        assert "Batch 1 · group 1 of 8" in text
        assert "What is 2 + 3?" in text
        assert "Completion 1 · Score: 1.0" in text and "Completion 2 · Score: -0.5" in text
        assert "5<|im_end|>" in text and "It is six" in text
        wait_for(browser, "/Queue: 0 groups/.test(document.body.innerText)", "the live counter")
        screenshot(browser, tmp_path / "view-run.png")
        # every group of the batch is kept: walk to the last one and back
        for k in range(2, 9):
            browser.evaluate("document.querySelector('#av-next').click()")
            wait_for(browser, f"/group {k} of 8/.test(document.querySelector('#av-view').innerText)",
                     f"group {k}")  # fmt: skip
        text = view_text(browser)
        assert "What is 6 + 1?" in text and "Score: 0.0" in text and "no idea" in text
        browser.evaluate("document.querySelector('#av-prev').click()")
        wait_for(browser, "/group 7 of 8/.test(document.querySelector('#av-view').innerText)",
                 "the previous group")  # fmt: skip
        # tokens on demand: the trained tokens are highlighted
        browser.evaluate("document.querySelector('#av-show-tokens input').click()")
        wait_for(browser, "document.querySelectorAll('#av-view .av-trained').length > 0",
                 "the token view")  # fmt: skip
        trained = browser.evaluate(
            "Array.from(document.querySelectorAll('#av-view .av-tokens')[0]"
            ".querySelectorAll('.av-trained')).map(e => e.textContent).join('')"
        )
        assert trained == "6<|im_end|>\n" or trained.startswith("6")
        screenshot(browser, tmp_path / "view-run-tokens.png")
        assert browser.evaluate("window.__pwned === undefined")
    finally:
        app.stop()


@pytest.mark.slow
def test_process_file_without_a_server(browser: Browser, tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    groups = [
        {"messages": [[{"role": "user", "content": "Name a colour"},
                       {"role": "assistant", "content": "<img src=x onerror=window.__pwned=1>"}],
                      [{"role": "user", "content": "Name a colour"},
                       {"role": "assistant", "content": "blue"}]],
         "scores": [-1.0, 1.0], "images": [PNG_1PX]},
        {"messages": ["just text"], "scores": [0.25]},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(g) + "\n" for g in groups))
    # --api-url points at a port nothing listens on: the file needs no server
    app = ViewRun(
        "--file", str(path), "--api-url", f"http://127.0.0.1:{free_port()}",
        "--tokenizer", str(_tokenizer()[0]), log=tmp_path / "view-run.log",
    )  # fmt: skip
    try:
        open_page(browser, app.url)
        wait_for(browser, "/Score: 1.0/.test(document.querySelector('#av-view').innerText)",
                 "the first group")  # fmt: skip
        text = view_text(browser)
        assert "Name a colour" in text and "blue" in text and "Score: -1.0" in text
        assert "<img src=x onerror=window.__pwned=1>" in text
        assert browser.evaluate("document.querySelectorAll('#av-view img.av-image').length") == 1
        assert browser.evaluate("window.__pwned === undefined")
        assert "File mode" in browser.evaluate("document.body.innerText")
        browser.evaluate("document.querySelector('#av-next').click()")
        wait_for(browser, "/Score: 0.25/.test(document.querySelector('#av-view').innerText)",
                 "the second group")  # fmt: skip
        screenshot(browser, tmp_path / "view-run-file.png")
    finally:
        app.stop()


@pytest.mark.slow
def test_grab_an_env_group_in_a_real_browser(
    browser: Browser, start_api, tiny_serve, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """run-api + the arithmetic env (``serve``, tiny model) + view-run: a real env's group."""
    from tests.cli.test_sft_gen import arithmetic_env, stop_proc

    api = start_api()
    app = ViewRun(
        "--api-url", api.url, "--tokenizer", str(tiny_model_dir), "--group-size", "4",
        "--batch-wait", "120", log=tmp_path / "view-run.log",
    )  # fmt: skip
    env = None
    try:
        env = arithmetic_env(api.url, tiny_serve.url, tiny_model_dir, tmp_path / "env.log")
        open_page(browser, app.url)
        browser.evaluate("document.querySelector('#av-grab').click()")
        wait_for(browser, "/Score: /.test(document.querySelector('#av-view').innerText)",
                 "the env's first group", timeout=180)  # fmt: skip
        text = view_text(browser)
        assert "What is" in text, text[:2000]
        # every completion of the group is shown with one of the env's default rewards
        # (1.0 right, 0.0 otherwise: environments/arithmetic_server.py score_reply)
        for k in range(1, 5):
            assert any(f"Completion {k} · Score: {s}" in text for s in ("1.0", "0.0")), text[:2000]
        screenshot(browser, tmp_path / "view-run-env.png")
    finally:
        if env is not None:
            stop_proc(env)
        app.stop()


def test_other_web_pages_cannot_use_the_viewer(tmp_path: Path) -> None:
    """DNS rebinding (another Host) and cross-origin POSTs are refused; the page itself works."""
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps({"messages": ["hello"], "scores": [1.0]}) + "\n")
    app = ViewRun(
        "--file", str(path), "--api-url", f"http://127.0.0.1:{free_port()}",
        "--tokenizer", str(_tokenizer()[0]), "--allowed-hosts", "viewer.lan",
        log=tmp_path / "view-run.log",
    )  # fmt: skip
    try:
        with httpx.Client(base_url=app.url, timeout=30) as client:
            assert client.get("/").status_code == 200
            assert client.get("/", headers={"Host": "viewer.lan:80"}).status_code == 200
            reply = client.get("/", headers={"Host": f"evil.example:{app.port}"})
            assert reply.status_code == 421 and "--allowed-hosts" in reply.text
            join = {"data": [], "fn_index": 0, "session_hash": "x"}
            reply = client.post(
                "/gradio_api/queue/join", json=join, headers={"Origin": "http://evil.example"}
            )
            assert reply.status_code == 403 and "cross-origin" in reply.text
            own = {"Origin": app.url.rstrip("/"), "Sec-Fetch-Site": "same-origin"}
            assert client.post("/gradio_api/queue/join", json=join, headers=own).status_code < 500
            assert client.post("/gradio_api/queue/join", json=join, headers=own).status_code != 403
    finally:
        app.stop()
