"""``atroposlib.utils.data.load_rows``: local JSONL / JSON datasets and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atroposlib.utils.data import load_rows

ROWS = [{"question": "1 + 1?", "answer": "#### 2"}, {"question": "2 + 2?", "answer": "#### 4"}]


def write_jsonl(path: Path, rows: list, blank_line: bool = False) -> Path:
    lines = [json.dumps(r) for r in rows]
    if blank_line:
        lines.insert(1, "   ")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_jsonl_file_is_every_split(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "rows.jsonl", ROWS, blank_line=True)
    assert load_rows(file, "train") == ROWS
    assert load_rows(str(file), "test") == ROWS


def test_json_files_hold_a_list_or_data(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    (tmp_path / "b.json").write_text(json.dumps({"data": ROWS}))
    assert load_rows(tmp_path / "a.json", "train") == ROWS
    assert load_rows(tmp_path / "b.json", "train") == ROWS


def test_a_folder_holds_one_file_per_split(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    (tmp_path / "test.json").write_text(json.dumps(ROWS[:1]))
    assert load_rows(tmp_path, "train") == ROWS
    assert load_rows(tmp_path, "test") == ROWS[:1]
    with pytest.raises(FileNotFoundError, match=r"validation\.jsonl"):
        load_rows(tmp_path, "validation")


def test_errors_name_the_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="dataset_path: no such file"):
        load_rows(tmp_path / "missing.jsonl", "train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl line 2"):
        load_rows(bad, "train")
    (tmp_path / "scalar.json").write_text("3")
    with pytest.raises(ValueError, match="expected a list of rows"):
        load_rows(tmp_path / "scalar.json", "train")
    write_jsonl(tmp_path / "list.jsonl", [ROWS[0], [1, 2]])
    with pytest.raises(ValueError, match="list.jsonl line 2 is not an object"):
        load_rows(tmp_path / "list.jsonl", "train")
    (tmp_path / "list.json").write_text(json.dumps([ROWS[0], 7]))
    with pytest.raises(ValueError, match="list.json row 2 is not an object"):
        load_rows(tmp_path / "list.json", "train")


def test_required_keys_types_and_emptiness_are_checked_naming_the_flag(tmp_path: Path) -> None:
    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS, blank_line=True)
    assert load_rows(rows, required=("question", "answer"), flag="tasks_path") == ROWS
    assert load_rows(rows, required={"question": str, "answer": (str, int)}) == ROWS
    # the blank line counts: the second row is on line 3
    partial = write_jsonl(tmp_path / "partial.jsonl", [ROWS[0], {"question": "q"}], True)
    with pytest.raises(
        ValueError, match=r"^tasks_path: .*partial\.jsonl line 3 lacks \['answer'\]"
    ):
        load_rows(partial, required=("question", "answer"), flag="tasks_path")
    typed = write_jsonl(tmp_path / "typed.jsonl", [{"prompt": 3}])
    with pytest.raises(ValueError, match="line 1: 'prompt' must be str, not int"):
        load_rows(typed, required={"prompt": str}, flag="prompts_path")
    with pytest.raises(ValueError, match="line 1: 'prompt' must be str/list, not int"):
        load_rows(typed, required={"prompt": (str, list)})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert load_rows(empty) == []
    with pytest.raises(ValueError, match="^prompts_path: .*empty.jsonl holds no rows"):
        load_rows(empty, flag="prompts_path", allow_empty=False)
    with pytest.raises(FileNotFoundError, match="^mbpp_path: no such file"):
        load_rows(tmp_path / "none.jsonl", flag="mbpp_path")
