"""``from atroposlib.envs import ...`` gives an env author every name they need, lazily."""

from __future__ import annotations

import subprocess
import sys

import atroposlib.envs as envs


def test_every_exported_name_resolves_to_its_home() -> None:
    from atroposlib.envs import base, rollout

    for name in envs.__all__:
        assert getattr(envs, name) is not None, name
    assert envs.BaseEnv is base.BaseEnv and envs.ChatSession is rollout.ChatSession
    assert set(envs.__all__) <= set(dir(envs))


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        envs.NotAThing  # noqa: B018
    except AttributeError as exc:
        assert "NotAThing" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


def test_a_submodule_import_does_not_load_the_env_runtime() -> None:
    code = "import sys, atroposlib.envs.throttle; print('atroposlib.envs.base' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
