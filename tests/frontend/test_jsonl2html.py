"""``atroposlib.frontend.jsonl2html``: grouping, escaping, warnings, the CLI."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from atroposlib.frontend.jsonl2html import (
    create_html_for_group,
    generate_html,
    get_score_class,
    render_markdown,
)

LOGGER = "atroposlib.frontend.jsonl2html"


def _write_jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text(
        "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n",
        encoding="utf-8",
    )
    return path


def test_score_classes() -> None:
    assert get_score_class(1) == "reward-positive"
    assert get_score_class("-0.5") == "reward-negative"
    assert get_score_class(0.0) == "reward-zero"
    assert get_score_class("n/a") == ""
    assert get_score_class(None) == ""
    assert get_score_class(float("nan")) == ""


def test_group_header_shows_step_and_mean_score() -> None:
    """Collapsed headers carry each group's step and mean score, so scrolling a run's page
    shows the rewards change."""
    early = create_html_for_group({"messages": ["a", "b"], "scores": [0.0, -0.5], "step": 0}, 0)
    late = create_html_for_group({"messages": ["a", "b"], "scores": [1.0, 0.5], "step": 12}, 9)
    assert (
        '<summary>Group 0 &middot; step 0 &middot; <span class="reward-negative-text">'
        "mean score -0.250</span> &middot; 2 rollouts</summary>"
    ) in early
    assert "Group 9 &middot; step 12 &middot;" in late
    assert '<span class="reward-positive-text">mean score +0.750</span>' in late
    odd = create_html_for_group({"messages": ["a"], "scores": ["n/a"], "step": True}, 1)
    assert "<summary>Group 1 &middot; 1 rollout</summary>" in odd


def test_group_with_conversations() -> None:
    group = {
        "messages": [
            [
                {"role": "system", "content": "be nice"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "**hello**"},
            ],
            "plain *string* rollout",
        ],
        "scores": [1.0, -1],
    }
    out = create_html_for_group(group, 3)
    assert out.startswith(
        "<details>\n    <summary>Group 3 &middot; "
        '<span class="reward-zero-text">mean score +0.000</span> &middot; 2 rollouts</summary>'
    )
    assert '<div class="item reward-positive" id="group-3-item-0">' in out
    assert '<div class="item reward-negative" id="group-3-item-1">' in out
    assert "<strong>System</strong>: be nice" in out
    assert "<strong>Assistant</strong>: <strong>hello</strong>" in out
    assert "<em>string</em>" in out
    assert "<p><strong>Reward:</strong> 1.0</p>" in out
    assert "<p><strong>Reward:</strong> -1</p>" in out


def test_content_parts_and_tool_calls() -> None:
    group = {
        "messages": [
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look at this"},
                        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
                },
            ]
        ],
        "scores": [0],
    }
    out = create_html_for_group(group, 0)
    assert "look at this" in out
    assert "<em>[image]</em>" in out
    assert "reward-zero" in out
    assert "&quot;name&quot;: &quot;f&quot;" in out or '"name": "f"' in out


def test_html_is_escaped() -> None:
    payload = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    group = {
        "messages": [[{"role": "<b>user</b>", "content": payload}], payload],
        "scores": ["<i>1</i>", 0],
    }
    out = create_html_for_group(group, 0)
    assert "<script" not in out and "<img" not in out and "<i>" not in out and "<b>" not in out
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in out
    assert "&lt;i&gt;1&lt;/i&gt;" in out


def test_markdown_renders_but_stays_safe() -> None:
    out = render_markdown(
        "```python\nif a < b:\n    print('<x>')\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
        "line one\nline two\n\n[bad](javascript:alert(1)) [bad2](JaVa\tScRiPt:alert(1)) "
        "[good](https://example.com) [rel](#frag) ![img](data:text/html,x) ![ok](data:image/png;base64,AA==)"
    )
    assert "<code class=\"language-python\">if a &lt; b:\n    print('&lt;x&gt;')" in out
    assert "<table>" in out and "<td>1</td>" in out
    assert "line one<br />" in out
    assert "javascript" not in out.lower().replace("\t", "")
    assert '<a href="https://example.com">good</a>' in out
    assert '<a href="#frag">rel</a>' in out
    assert 'src="data:text/html' not in out
    assert 'src="data:image/png;base64,AA=="' in out


def test_mismatched_lengths_truncate_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = create_html_for_group({"messages": ["a", "b", "c"], "scores": [1, 2]}, 7)
    assert "group-7-item-1" in out and "group-7-item-2" not in out
    assert "Group 7 has 3 messages but 2 scores" in caplog.text


def test_empty_group_is_omitted(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert create_html_for_group({"messages": [], "scores": []}, 0) == ""
        assert create_html_for_group({"messages": ["a"], "scores": []}, 1) == ""
    assert "no rollouts" in caplog.text


def test_generate_html_skips_bad_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = _write_jsonl(
        tmp_path / "run.jsonl",
        [
            {"messages": ["first"], "scores": [1]},
            "{not json",
            "",
            {"messages": ["no scores"]},
            [1, 2, 3],
            {"messages": [], "scores": []},
            {"messages": ["second"], "scores": [-1]},
        ],
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = generate_html(src)
    assert out == tmp_path / "run.html"
    page = out.read_text(encoding="utf-8")
    assert "Skipping line 2: invalid JSON" in caplog.text
    assert "Skipping line 4" in caplog.text
    assert "Skipping line 5" in caplog.text
    assert "Skipping line 3" not in caplog.text  # blank lines are silently ignored
    # Rendered groups are numbered consecutively.
    assert "<summary>Group 0 &middot;" in page and "<summary>Group 1 &middot;" in page
    assert "<summary>Group 2 &middot;" not in page
    assert page.index("first") < page.index("second")
    assert "<title>Rendered Messages - run.jsonl</title>" in page


def test_generate_html_output_path_and_placeholders(tmp_path: Path) -> None:
    src = _write_jsonl(
        tmp_path / "a<b>.jsonl",
        [{"messages": ["literal {title} and {groups_html} and {nonce}"], "scores": [0]}],
    )
    out = generate_html(src, tmp_path / "sub" / "dir" / "page.html")
    page = out.read_text(encoding="utf-8")
    assert out == tmp_path / "sub" / "dir" / "page.html"
    assert "<title>Rendered Messages - a&lt;b&gt;.jsonl</title>" in page
    # Placeholders inside the data are not substituted; none are left in the template.
    assert "literal {title} and {groups_html} and {nonce}" in page
    assert page.count("{title}") == 1 and page.count("{groups_html}") == 1
    nonce = page.split('<script nonce="', 1)[1].split('"', 1)[0]
    assert len(nonce) >= 16 and f"'nonce-{nonce}'" in page
    second = generate_html(src, tmp_path / "again.html").read_text(encoding="utf-8")
    assert nonce not in second


def test_generate_html_empty_and_missing(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    assert "No data to display" in generate_html(empty).read_text(encoding="utf-8")
    with pytest.raises(FileNotFoundError):
        generate_html(tmp_path / "missing.jsonl")


def test_template_is_packaged() -> None:
    template = resources.files("atroposlib.frontend").joinpath("template.html").read_text("utf-8")
    assert "{title}" in template and "{groups_html}" in template


def test_cli(tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", [{"messages": ["hello"], "scores": [1]}, "oops"])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "atroposlib.frontend.jsonl2html",
            str(src),
            str(tmp_path / "o.html"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "Skipping line 2" in done.stderr
    assert "hello" in (tmp_path / "o.html").read_text(encoding="utf-8")
    missing = subprocess.run(
        [sys.executable, "-m", "atroposlib.frontend.jsonl2html", str(tmp_path / "nope.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1
    assert "not found" in missing.stderr
