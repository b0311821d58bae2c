"""The generated page in a real headless Chromium: no JS errors, nothing injected runs, and the
keyboard navigation works. Skipped when no Chromium is installed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from atroposlib.frontend.jsonl2html import generate_html
from tests.frontend.chromium import Browser, find_chromium

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")

PAYLOAD = "<script>window.__pwned = 1</script>"
IMG_PAYLOAD = '<img src=x onerror="window.__pwned = 2">'

GROUPS = [
    {
        "messages": [
            [
                {"role": "user", "content": f"Please repeat {PAYLOAD}"},
                {
                    "role": "assistant",
                    "content": f"Sure: {PAYLOAD} {IMG_PAYLOAD}\n\n**bold** and\n```js\nif (a < b) {{}}\n```",
                },
            ],
            "second rollout [click](javascript:window.__pwned=3)",
        ],
        "scores": [1.0, -1.0],
    },
    {"messages": ["group one, item zero", "group one, item one"], "scores": [0, 0.5]},
    {"messages": ["group two"], "scores": [2]},
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    pytest.importorskip("websockets", reason="websockets is needed to drive chromium")
    assert CHROMIUM is not None
    b = Browser(CHROMIUM)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("html") / "rollouts.jsonl"
    src.write_text("\n".join(json.dumps(g) for g in GROUPS) + "\n", encoding="utf-8")
    return generate_html(src)


def test_renders_without_errors_and_nothing_injected_runs(browser: Browser, page: Path) -> None:
    browser.navigate(page)
    assert browser.errors() == []
    assert browser.evaluate("window.__pwned === undefined")
    # The page's own script ran (under its CSP nonce) ...
    assert browser.evaluate("window.atroposViewer.itemCount") == 5
    assert browser.evaluate("window.atroposViewer.groupCount") == 3
    # ... and is the only script element.
    assert browser.evaluate("document.scripts.length") == 1
    assert browser.evaluate("document.querySelectorAll('#groups-container img').length") == 0
    text = browser.evaluate("document.getElementById('group-0-item-0').textContent")
    assert PAYLOAD in text
    assert IMG_PAYLOAD in text
    assert (
        browser.evaluate("document.querySelector('#group-0-item-0 strong').textContent") == "User"
    )
    assert browser.evaluate("document.querySelector('#group-0-item-0 pre code').textContent") == (
        "if (a < b) {}\n"
    )
    assert (
        browser.evaluate("document.querySelector('#group-0-item-1 a').hasAttribute('href')")
        is False
    )
    assert browser.evaluate("document.title") == "Rendered Messages - rollouts.jsonl"


def _active(browser: Browser) -> str | None:
    return browser.evaluate("window.atroposViewer.activeItemId()")


def _open(browser: Browser) -> list[bool]:
    return browser.evaluate("Array.from(document.querySelectorAll('details')).map(d => d.open)")


def test_keyboard_navigation(browser: Browser, page: Path) -> None:
    browser.navigate(page)
    assert _open(browser) == [False, False, False]
    assert _active(browser) is None

    browser.press("j")
    assert _active(browser) == "group-0-item-0"
    assert _open(browser) == [True, False, False]
    browser.press("ArrowDown")
    assert _active(browser) == "group-0-item-1"
    browser.press("j")  # crosses into the next group and opens it
    assert _active(browser) == "group-1-item-0"
    assert _open(browser) == [True, True, False]
    browser.press("k")
    assert _active(browser) == "group-0-item-1"
    browser.press("ArrowUp")
    assert _active(browser) == "group-0-item-0"
    browser.press("k")  # stays at the top
    assert _active(browser) == "group-0-item-0"
    assert browser.evaluate("document.activeElement.id") == "group-0-item-0"

    browser.press("n")
    assert browser.evaluate("window.atroposViewer.activeGroupIndex()") == 1
    assert _active(browser) is None
    browser.press("ArrowRight")
    assert browser.evaluate("window.atroposViewer.activeGroupIndex()") == 2
    browser.press("o")  # expand group 2
    assert _open(browser) == [True, True, True]
    browser.press("Enter")  # collapse it again
    assert _open(browser) == [True, True, False]
    browser.press("p")
    browser.press("ArrowLeft")
    assert browser.evaluate("window.atroposViewer.activeGroupIndex()") == 0
    browser.press("j")  # into the current group
    assert _active(browser) == "group-0-item-0"

    browser.press("c")
    assert _open(browser) == [False, False, False]
    browser.press("e")
    assert _open(browser) == [True, True, True]
    assert browser.errors() == []


def test_click_selects_item(browser: Browser, page: Path) -> None:
    browser.navigate(page)
    browser.press("e")
    browser.evaluate("document.getElementById('group-1-item-1').click()")
    assert _active(browser) == "group-1-item-1"
    browser.press("j")
    assert _active(browser) == "group-2-item-0"
    assert browser.errors() == []


def test_harness_sees_errors_and_injection(browser: Browser, tmp_path: Path) -> None:
    """Guards the checks above: a page that throws, and raw HTML, are caught by the harness."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<html><body><script>throw new Error('boom')</script>"
        "<script>window.__pwned = 1</script></body></html>",
        encoding="utf-8",
    )
    browser.navigate(bad)
    assert any("boom" in e for e in browser.errors())
    assert browser.evaluate("window.__pwned") == 1
