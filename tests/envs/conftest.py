"""Fixtures of the env tests: an ``atropos-serve`` whose model plays tool-using episodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, start_server
from tests.upstream_envs.scripted_model import build_scripted_model

STANDINS = REPO / "tests" / "upstream_envs" / "standins"
CALL = '<tool_call>{"name": "increment", "arguments": {"step": %d}}</tool_call>'
BAD = '<tool_call>{"name": "increment", "arguments": {"step": "two"}}</tool_call>'
ACT = '<tool_call>{"name": "act", "arguments": {"direction": "%s", "steps": %d}}</tool_call>'
MOVE = '<tool_call>{"name": "move", "arguments": {"direction": "%s"}}</tool_call>'
#: First rule whose text is in the prompt picks the replies (a group samples among them).
RULES = {
    "<tool_response>\n2\n</tool_response>": ["Done."],
    "<tool_response>\n1\n</tool_response>": [CALL % 1],
    "<|im_start|>tool\n2<|im_end|>": ["Done."],  # tool_format openai: plain tool messages
    "<|im_start|>tool\n1<|im_end|>": [CALL % 1],
    '{"error"': ["Sorry."],
    "Reach 2.": [CALL % 1, CALL % 2, "I give up.", BAD],
    "You found the treasure!": ["I won."],
    "You see a door.": [MOVE % "north"],
    "Find the treasure.": [MOVE % "north", MOVE % "up"],
    # OpenEnv (tests/envs/openenv_envs.py): the word game, then the walk (tool mode)
    "Not my fruit.": ["pear"],
    "Guess my fruit (4 letters).": ["pear", "apple"],
    '"position": 1': [ACT % ("north", 2)],
    "Walk to the exit": [ACT % ("north", 3), ACT % ("north", 1), ACT % ("south", 1)],
}


def start_scripted_server(tmp_path_factory: pytest.TempPathFactory, model: Path):
    """``atropos-serve`` running a scripted model (``build_scripted_model``) as ``tiny``; the
    caller stops it."""
    with pytest.MonkeyPatch.context() as patch:  # the server loads the scripted model type
        patch.setenv("PYTHONPATH", str(STANDINS))
        patch.setenv("ATROPOS_SCRIPTED_MODEL", "1")
        return start_server(
            tmp_path_factory, model, "--dtype", "float32", "--served-model-name", "tiny"
        )


@pytest.fixture(scope="session")
def scripted_tools(tmp_path_factory: pytest.TempPathFactory):
    """atropos-serve running the scripted tool user, served as ``tiny``."""
    model = build_scripted_model(tmp_path_factory.mktemp("scripted") / "tools", RULES)
    server = start_scripted_server(tmp_path_factory, model)
    try:
        yield server, model
    finally:
        server.stop()
