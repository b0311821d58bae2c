"""CONFIG.md is generated from the config models and must not drift from them."""

from __future__ import annotations

from atroposlib.cli.config_docs import update
from tests.conftest import REPO


def test_config_md_is_up_to_date() -> None:
    text = (REPO / "CONFIG.md").read_text()
    assert update(text) == text, "run: python -m atroposlib.cli.config_docs --write"


def test_every_api_setting_is_documented() -> None:
    from atroposlib.api.settings import ApiSettings

    text = (REPO / "CONFIG.md").read_text()
    for name in ApiSettings.model_fields:
        assert f"`ATROPOS_{name.upper()}`" in text
