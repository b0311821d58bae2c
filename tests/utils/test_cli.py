"""``atroposlib.utils.cli``: the one pydantic-model-to-flags helper every command uses, and
upstream's ``merge_dicts`` / ``extract_namespace``."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import AliasChoices, BaseModel, Field

from atroposlib.utils.cli import (
    REPEATABLE,
    FlagError,
    ModelArgumentParser,
    ModelFlags,
    extract_namespace,
    merge_dicts,
    parse_model,
)


class Options(BaseModel):
    path: str = Field(description="Where to write.")
    group_size: int = Field(4, ge=1, description="Sequences per group.")
    use_wandb: bool = Field(True, description="Log to W&B.")
    mode: Literal["fast", "slow"] = Field("fast", description="How.")
    names: list[str] = Field(default_factory=list, description="Names.")
    limit: int | None = Field(None, description="A limit.")
    extra: dict[str, int] | None = Field(None, description="Extra.")
    base_url: str = Field(
        "http://x", validation_alias=AliasChoices("base_url", "url"), description="URL."
    )


def parse(argv: list[str], prefix: str = "", **kwargs) -> Options:
    flags = ModelFlags(Options, prefix=prefix, positional=("path",) if not prefix else (),
                       **kwargs)  # fmt: skip
    parser = ModelArgumentParser(prog="tool")
    flags.add_to(parser)
    base = {"path": "p"} if prefix else None
    model, _ = parse_model(flags, parser, argv, base=base)
    assert isinstance(model, Options)
    return model


def test_plain_flags_kebab_canonical_snake_accepted() -> None:
    opts = parse(["out.jsonl", "--group-size", "8"])
    assert opts.path == "out.jsonl" and opts.group_size == 8
    assert parse(["--group_size", "3", "out"]).group_size == 3
    assert parse(["out", "--url", "http://y"]).base_url == "http://y"  # validation alias
    assert parse(["out", "--base-url=http://z"]).base_url == "http://z"


def test_namespaced_flags_keep_the_field_spelling() -> None:
    assert parse(["--env.group_size", "5"], prefix="env.").group_size == 5
    assert parse(["--env.group-size", "6"], prefix="env.").group_size == 6


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--use-wandb"], True),
        (["--no-use-wandb"], False),
        (["--use-wandb", "false"], False),
        (["--use-wandb=no"], False),
        (["--use_wandb", "0"], False),
        (["--no-use_wandb"], False),
        (["--use-wandb", "TRUE"], True),
    ],
)
def test_boolean_forms(argv: list[str], expected: bool) -> None:
    assert parse([*argv, "out"]).use_wandb is expected
    # a bare boolean never swallows the positional after it
    assert parse([*argv[:1], "out"]).path == "out"


def test_lists_dicts_and_none() -> None:
    assert parse(["out", "--names", "a", "b"]).names == ["a", "b"]
    assert parse(["out", "--names", '["c", "d"]']).names == ["c", "d"]
    assert parse(["out", "--extra", '{"k": 1}']).extra == {"k": 1}
    assert parse(["out", "--limit", "None"]).limit is None
    assert parse(["out", "--limit", "7"]).limit == 7


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["out", "--group-size", "0"], "--group-size '0': Input should be greater than or equal"),
        (["out", "--mode", "medium"], "--mode 'medium': Input should be 'fast' or 'slow'"),
        (["out", "--use-wandb=maybe"], "--use-wandb 'maybe': expected true or false"),
        (["out", "--no-use-wandb=1"], "--no-use-wandb '1': takes no value"),
        ([], "required: FILE"),
    ],
)
def test_bad_values_exit_2_naming_the_flag(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    if message == "required: FILE":
        assert "PATH" in err  # argparse's own missing-positional message names it
    else:
        assert message in err


def test_help_shows_canonical_spelling_and_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--group-size GROUP_SIZE Sequences per group. (default: 4)" in out
    assert "--use-wandb [BOOL], --no-use-wandb Log to W&B. (default: True)" in out
    assert "--group_size" not in out
    env = ModelFlags(Options, env_prefix="APP_").specs["limit"]
    assert env.help == "A limit. (default: None; env APP_LIMIT)"


def test_build_layers_and_names_the_source() -> None:
    flags = ModelFlags(Options, prefix="env.")
    parser = ModelArgumentParser(prog="x")
    flags.add_to(parser)
    args = parser.parse_args(["--env.group_size", "9"])
    model = flags.build(args, base={"path": "a", "mode": "slow"}, config={"limit": 3})
    assert (model.path, model.mode, model.limit, model.group_size) == ("a", "slow", 3, 9)
    with pytest.raises(FlagError, match=r"env.group_size in c.yaml: Input should be a valid"):
        flags.build(parser.parse_args([]), base={"path": "a"}, config={"group_size": "x"},
                    config_path="c.yaml")  # fmt: skip
    with pytest.raises(FlagError, match=r"--env.path: Field required"):
        flags.build(parser.parse_args([]))
    assert flags.canonical_key("base-url") == "base_url" and flags.canonical_key("url") == (
        "base_url"
    )
    assert flags.canonical_key("nope") is None


class Passthrough(BaseModel):
    extra_arg: list[str] = Field(
        default_factory=list, json_schema_extra=REPEATABLE, description="Passed on."
    )
    counts: list[int] = Field(default_factory=list, json_schema_extra=REPEATABLE, description="N.")
    names: list[str] = Field(default_factory=list, description="Names.")
    group_size: int = Field(4, description="Sequences per group.")


def parse_passthrough(argv: list[str], **kwargs) -> Passthrough:
    flags = ModelFlags(Passthrough)
    parser = ModelArgumentParser(prog="tool")
    flags.add_to(parser)
    model, _ = parse_model(flags, parser, argv, **kwargs)
    assert isinstance(model, Passthrough)
    return model


def test_repeatable_flag_takes_one_value_per_occurrence() -> None:
    assert parse_passthrough([]).extra_arg == []
    opts = parse_passthrough(["--extra-arg", "a=1", "--extra_arg=b=2", "--extra-arg", "[1, 2]"])
    assert opts.extra_arg == ["a=1", "b=2", "[1, 2]"]  # kept as written, no JSON parsing
    # a value that starts with "-" is attached with "="; a negative number needs no "="
    opts = parse_passthrough(["--extra-arg=--dtype", "--extra-arg=float32", "--extra-arg", "-1"])
    assert opts.extra_arg == ["--dtype", "float32", "-1"]
    assert parse_passthrough(["--counts", "3", "--counts=4"]).counts == [3, 4]  # items validated
    # a plain list flag still takes its values in one go
    assert parse_passthrough(["--names", "a", "b"]).names == ["a", "b"]


def test_repeatable_flag_adds_to_the_layers_below(capsys) -> None:
    base = {"extra_arg": ["x=1"], "group_size": 8}
    opts = parse_passthrough(["--extra-arg", "x=2"], base=base)
    assert opts.extra_arg == ["x=1", "x=2"] and opts.group_size == 8
    assert parse_passthrough([], base=base).extra_arg == ["x=1"]
    # base may depend on the flags given (a preset one flag picks)
    picked = parse_passthrough(
        ["--group-size", "2", "--extra-arg", "y"],
        base=lambda given: {"extra_arg": [f"size={given['group_size']}"]},
    )
    assert picked.extra_arg == ["size=2", "y"]
    flags = ModelFlags(Passthrough)
    parser = ModelArgumentParser(prog="tool")
    flags.add_to(parser)
    built = flags.build(parser.parse_args(["--counts", "3"]), base={"counts": [1]},
                        config={"counts": [2]})  # fmt: skip
    assert isinstance(built, Passthrough) and built.counts == [2, 3]  # config replaces base


def test_repeatable_flag_errors_and_help(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_passthrough(["--counts", "3", "--counts", "x"])
    assert info.value.code == 2
    assert "--counts '3 x': Input should be a valid integer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        parse_passthrough(["--extra-arg", "--dtype"])  # a value starting with "-" needs "="
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--extra-arg" in err and "expected one argument" in err
    with pytest.raises(SystemExit):
        parse_passthrough(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--extra-arg EXTRA_ARG Passed on. (repeatable; default: [])" in out
    assert ModelFlags(Passthrough).specs["extra_arg"].repeatable

    class NotAList(BaseModel):
        x: int = Field(0, json_schema_extra=REPEATABLE)

    with pytest.raises(TypeError, match="repeatable flag needs a list field"):
        ModelFlags(NotAList)


def test_abbreviations_of_both_spellings_name_one_flag(capsys) -> None:
    assert parse_passthrough(["--group", "2"]).group_size == 2  # --group-size and --group_size
    assert parse_passthrough(["--extra", "a"]).extra_arg == ["a"]
    with pytest.raises(SystemExit) as info:
        parse(["out", "--u", "x"])  # --use-wandb or --url: still ambiguous
    assert info.value.code == 2
    assert "ambiguous option" in capsys.readouterr().err


def test_merge_dicts_is_recursive_and_pure() -> None:
    a = {"env": {"x": 1, "y": {"z": 2}}, "k": 1}
    b = {"env": {"y": {"w": 3}}, "k": 2}
    assert merge_dicts(a, b, {"new": None}) == {
        "env": {"x": 1, "y": {"z": 2, "w": 3}},
        "k": 2,
        "new": None,
    }
    assert a == {"env": {"x": 1, "y": {"z": 2}}, "k": 1}
    assert merge_dicts() == {}
    assert merge_dicts({"a": {"b": 1}}, {"a": 5}) == {"a": 5}


def test_extract_namespace() -> None:
    flags = {"env.group_size": 4, "openai.base_url": "u", "env.x": None}
    assert extract_namespace(flags, "env.") == {"group_size": 4, "x": None}

    class M(BaseModel):
        teacher_a: int = 1
        b: int = 2

    assert extract_namespace(M(), "teacher_") == {"a": 1}

    class D:
        def to_dict(self) -> dict:
            return {"p.q": 1}

    assert extract_namespace(D(), "p.") == {"q": 1}
    with pytest.raises(TypeError):
        extract_namespace(3, "x")
