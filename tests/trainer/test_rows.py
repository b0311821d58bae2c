"""``atroposlib.trainer``: how a trainer reads a group, through the library API.

The rules (prompt/completion split, advantages, sampler log-probs, temperature, policy
version) are the contract every trainer shares; these tests pin them on hand-built groups,
check that a malformed group is refused naming its field, that the module works without torch,
and that the torch helpers' padded and packed layouts give the model's own log-probabilities.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from atroposlib.trainer import (
    MalformedGroupError,
    rows_from_batch,
    rows_from_group,
    validate_group,
)


def _group(**extra):
    group = {
        "tokens": [[1, 5, 6, 7, 8, 9], [1, 5, 6, 10, 11], [1, 5, 6, 12]],
        "masks": [[-100, -100, -100, 7, 8, 9], [-100, -100, -100, 10, 11], [-100, -100, -100, 12]],
        "scores": [1.0, 0.0, 0.5],
    }
    group.update(extra)
    return group


def test_prompt_completion_split_and_score_advantages() -> None:
    rows = rows_from_group(_group())
    assert [r.prompt_ids for r in rows] == [[1, 5, 6]] * 3
    assert [r.completion_ids for r in rows] == [[7, 8, 9], [10, 11], [12]]
    assert [r.loss_mask for r in rows] == [[1, 1, 1], [1, 1], [1]]
    scores = [1.0, 0.0, 0.5]
    mean, std = statistics.mean(scores), statistics.stdev(scores)  # sample std, as upstream
    for row, score in zip(rows, scores, strict=True):
        expected = (score - mean) / std
        assert row.advantages == pytest.approx([expected] * len(row.completion_ids))
        assert row.advantage == pytest.approx(expected)
        assert row.advantage_source == "scores"
        assert row.tokens[: len(row.prompt_ids)] == [1, 5, 6]
    assert rows[0].labels == [-100, -100, -100, 7, 8, 9]
    assert [r.index for r in rows] == [0, 1, 2] and {r.group_size for r in rows} == {3}


def test_scale_none_only_centres_and_a_group_of_one_keeps_its_score() -> None:
    rows = rows_from_group(_group(), scale="none")
    assert [r.advantage for r in rows] == pytest.approx([0.5, -0.5, 0.0])
    single = _group(tokens=[[1, 2, 3]], masks=[[-100, 2, 3]], scores=[0.25])
    assert rows_from_group(single)[0].advantages == [0.25, 0.25]
    flat = rows_from_group(_group(scores=[1.0, 1.0, 1.0]))
    assert all(r.advantages == [0.0] * len(r.completion_ids) for r in flat)
    assert not any(r.has_signal for r in flat)


def test_set_advantage_to_zero_keeps_the_score_in_the_baseline() -> None:
    """Zeroing the *advantage* (not the score): the other sequences keep the advantages the
    full group gives them."""
    zeroed = _group(overrides=[{}, {"set_advantage_to_zero": True}, None])
    rows = rows_from_group(zeroed)
    plain = rows_from_group(_group())
    assert rows[1].advantages == [0.0, 0.0] and rows[1].advantage_source == "zeroed"
    assert rows[0].advantages == pytest.approx(plain[0].advantages)
    assert rows[2].advantages == pytest.approx(plain[2].advantages)
    assert rows[1].score == 0.0  # the score itself is reported unchanged


def test_explicit_advantages_win_over_scores() -> None:
    group = _group(advantages=[[0.0, 0.0, 0.0, -1.0, -2.0, -3.0], [2.5], [0, 0, 0, 4.0]])
    rows = rows_from_group(group)
    assert rows[0].advantages == [-1.0, -2.0, -3.0]  # per token, completion part
    assert rows[1].advantages == [2.5, 2.5]  # one value for the sequence
    assert rows[2].advantages == [4.0]
    assert {r.advantage_source for r in rows} == {"explicit"}


def test_multi_turn_env_tokens_are_in_the_completion_but_not_trained() -> None:
    # user prompt | assistant turn | tool output (masked) | assistant turn
    group = {
        "tokens": [[1, 2, 3, 40, 41, 90, 91, 92, 42, 43]],
        "masks": [[-100, -100, -100, 40, 41, -100, -100, -100, 42, 43]],
        "scores": [1.0],
        "inference_logprobs": [[1.0, 1.0, 1.0, -0.1, -0.2, 1.0, 1.0, 1.0, -0.3, -0.4]],
    }
    (row,) = rows_from_group(group)
    assert row.prompt_ids == [1, 2, 3]
    assert row.completion_ids == [40, 41, 90, 91, 92, 42, 43]
    assert row.loss_mask == [1, 1, 0, 0, 0, 1, 1]
    # the 1.0 sentinel (no sampler log-prob) reads as None
    assert row.sampler_logprobs == [-0.1, -0.2, None, None, None, -0.3, -0.4]
    assert row.num_trained == 4


def test_temperature_policy_version_env_id_and_flags() -> None:
    group = _group(
        overrides=[{"temperature": 0.3, "sft": True}, {}, {}],
        generation_params={"temperature": 0.7},
        group_overrides={"temperature": 0.9},
        policy_version=12,
        env_id=4,
    )
    rows = rows_from_group(group, index=5)
    assert [r.temperature for r in rows] == [0.3, 0.7, 0.7]
    assert rows_from_group(_group(group_overrides={"temperature": 0.9}))[0].temperature == 0.9
    assert rows_from_group(_group())[0].temperature == 1.0
    assert {r.policy_version for r in rows} == {12}
    assert {r.env_id for r in rows} == {4} and {r.group for r in rows} == {5}
    assert rows[0].extra == {"temperature": 0.3, "sft": True}
    assert rows_from_group(_group())[0].policy_version is None


def test_truncation_is_read_like_the_temperature() -> None:
    group = _group(
        overrides=[{"top_p": 0.5}, {}, {}],
        generation_params={"top_k": 20, "top_p": 0.8, "min_p": 0.05},
        group_overrides={"top_k": 3},
    )
    rows = rows_from_group(group)
    assert [(r.top_k, r.top_p, r.min_p) for r in rows] == [(20, 0.5, 0.05)] + [(20, 0.8, 0.05)] * 2
    (row, *_) = rows_from_group(_group(generation_params={"top_k": 0}))
    assert (row.top_k, row.top_p, row.min_p) == (-1, 1.0, 0.0)  # 0 switches top-k off (vLLM)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_p": 0.0}, "generation_params.top_p"),
        ({"top_p": 1.5}, "generation_params.top_p"),
        ({"top_p": "0.8"}, "generation_params.top_p"),
        ({"top_k": 2.5}, "generation_params.top_k"),
        ({"top_k": -2}, "generation_params.top_k"),
        ({"min_p": True}, "generation_params.min_p"),
    ],
)
def test_bad_truncation_is_refused_naming_the_field(params, field) -> None:
    with pytest.raises(MalformedGroupError) as info:
        rows_from_batch([_group(), _group(generation_params=params)])
    assert info.value.field == field and info.value.group == 1
    assert str(info.value).startswith(f"group 1: {field} must be")


def test_first_token_is_never_a_completion() -> None:
    """Nothing predicts a sequence's first token: a label there is not trained (the shift of
    every causal-LM trainer drops it), and the prompt is never empty."""
    (row,) = rows_from_group({"tokens": [[7, 8, 9]], "masks": [[7, 8, 9]], "scores": [1.0]})
    assert row.prompt_ids == [7] and row.completion_ids == [8, 9]
    (untrained,) = rows_from_group({"tokens": [[7, 8]], "masks": [[-100, -100]], "scores": [0.0]})
    assert untrained.completion_ids == [] and untrained.num_trained == 0


def test_rows_from_batch_numbers_groups() -> None:
    rows = rows_from_batch([_group(), _group(policy_version=2)])
    assert [r.group for r in rows] == [0, 0, 0, 1, 1, 1]
    assert [r.policy_version for r in rows] == [None] * 3 + [2] * 3


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"masks": [[-100, 7], [-100, 10], [-100, 12]]}, "masks[0]", "masks[0] has 2 entries"),
        (
            {"masks": [[-100, -100, -100, 7, 8, 9], [-100, -100, -100, 10, 99], [-100] * 4]},
            "masks[1][4]",
            "masks[1][4] is 99 but tokens[1][4] is 11",
        ),
        ({"scores": [1.0, float("nan"), 0.0]}, "scores[1]", "scores[1] is not a finite number"),
        ({"scores": [1.0, 0.0]}, "scores", "scores has 2 entries"),
        ({"tokens": [], "masks": [], "scores": []}, "tokens", "group is empty"),
        ({"advantages": [[1.0, 2.0], [1.0], [1.0]]}, "advantages[0]", "advantages[0] has 2"),
        ({"inference_logprobs": [[-1.0], [-1.0], [-1.0]]}, "inference_logprobs[0]", "has 1"),
        ({"policy_version": -1}, "policy_version", "policy_version"),
        ({"tokens": "abc"}, "tokens", "tokens"),
    ],
)
def test_malformed_groups_are_refused_naming_the_field(change, field, words) -> None:
    group = _group(**change)
    with pytest.raises(MalformedGroupError) as info:
        rows_from_batch([_group(), group])
    assert info.value.field == field
    assert info.value.group == 1
    assert str(info.value).startswith("group 1: ")
    assert words in str(info.value)


def test_missing_required_key_is_named() -> None:
    group = _group()
    del group["scores"]
    with pytest.raises(MalformedGroupError, match="scores") as info:
        validate_group(group)
    assert info.value.field == "scores"
    with pytest.raises(MalformedGroupError, match="expected a group"):
        rows_from_batch(["not a group"])


def test_reading_groups_needs_no_torch() -> None:
    """The trainer's half of the contract imports and runs where torch is not installed."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from atroposlib.trainer import rows_from_batch, TrainerClient\n"
        "rows = rows_from_batch([{'tokens': [[1, 2, 3]], 'masks': [[-100, 2, 3]], "
        "'scores': [1.0]}])\n"
        "assert rows[0].completion_ids == [2, 3], rows\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "try:\n"
        "    from atroposlib.trainer import pad_rows\n"
        "except ImportError:\n"
        "    print('no torch: ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "no torch: ok" in out.stdout


# ------------------------------------------------------------------------------ torch helpers


def test_pad_rows_aligns_every_tensor_with_the_tokens() -> None:
    from atroposlib.trainer import pad_rows

    group = _group(inference_logprobs=[[1, 1, 1, -0.5, -0.2, -0.1], [1, 1, 1, -1, -2], [1] * 4])
    rows = rows_from_group(group)
    batch = pad_rows(rows, pad_id=0, pad_to_multiple_of=4)
    assert batch.input_ids.shape == (3, 8)
    assert batch.input_ids[1].tolist() == [1, 5, 6, 10, 11, 0, 0, 0]
    assert batch.attention_mask[1].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert batch.loss_mask[1].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    assert batch.labels[1].tolist() == [-100, -100, -100, 10, 11, -100, -100, -100]
    assert batch.advantages[1, 3].item() == pytest.approx(rows[1].advantage)
    assert batch.advantages[1, :3].tolist() == [0.0] * 3
    assert batch.sampler_logprobs[0, 3:6].tolist() == pytest.approx([-0.5, -0.2, -0.1])
    assert math.isnan(batch.sampler_logprobs[0, 0].item())
    assert math.isnan(batch.sampler_logprobs[2, 3].item())  # 1.0 sentinel -> unknown


def test_packed_and_padded_layouts_give_the_model_s_log_probs(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from atroposlib.trainer import pack_rows, pad_rows, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    groups = [
        _group(generation_params={"temperature": 0.7}),
        {
            "tokens": [[1, 20, 21, 22], [1, 20, 23, 24, 25, 26, 27]],
            "masks": [[-100, -100, 21, 22], [-100, -100, 23, 24, -100, -100, 27]],
            "scores": [0.5, 0.0],
        },
    ]
    rows = rows_from_batch(groups)
    padded = pad_rows(rows)
    packed = pack_rows(rows, max_tokens=12)
    assert sum(len(lens) for lens in packed.seq_lens) == len(rows)
    assert all(sum(lens) <= 12 for lens in packed.seq_lens)
    with torch.no_grad():
        logits = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits
        pad_lp = token_logprobs(logits, padded.input_ids, padded.temperatures)
        out = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=packed.attention_mask_4d(),
        ).logits
        pack_lp = token_logprobs(out, packed.input_ids, packed.temperatures)
        # reference: each sequence alone, temperature applied by hand
        for i, row in enumerate(rows):
            ids = torch.tensor([row.tokens])
            alone = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / row.temperature, -1)
            expected = alone.gather(-1, ids[0, 1:, None]).squeeze(-1)
            n = len(row.tokens)
            assert torch.allclose(pad_lp[i, 1:n], expected, atol=1e-5)
    for r, (members, lens) in enumerate(zip(packed.row_index, packed.seq_lens, strict=True)):
        start = 0
        for i, n in zip(members, lens, strict=True):
            trained = packed.loss_mask[r, start : start + n]
            assert torch.equal(trained, padded.loss_mask[i, :n])
            assert torch.allclose(
                pack_lp[r, start : start + n] * trained, pad_lp[i, :n] * trained, atol=1e-5
            )
            start += n


def test_token_logprobs_replay_the_sampler_s_truncation(tiny_model_dir: Path) -> None:
    """With top-k/top-p/min-p the log-probs are those of the truncated, renormalised,
    temperature-scaled distribution (vLLM's processed_logprobs), computed here by hand."""
    import torch
    from transformers import AutoModelForCausalLM

    from atroposlib.trainer import pad_rows, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    params = {"temperature": 0.7, "top_k": 40, "top_p": 0.6, "min_p": 0.01}
    (row, *_) = rows = rows_from_group(_group(generation_params=params))
    batch = pad_rows(rows)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
        got = token_logprobs(
            logits, batch.input_ids, batch.temperatures, batch.top_k, batch.top_p, batch.min_p
        )
        scaled = logits[0, :-1] / 0.7
        probs = scaled.softmax(-1)
        keep = probs >= 0.01 * probs.max(-1, keepdim=True).values  # min-p
        kth = scaled.masked_fill(~keep, float("-inf")).topk(40, -1).values[:, -1:]
        keep &= scaled >= kth  # top-k
        ordered = scaled.masked_fill(~keep, float("-inf")).sort(-1, descending=True)
        mass = ordered.values.softmax(-1)
        stays = (mass.cumsum(-1) - mass) < 0.6  # top-p: the mass before a token is below p
        keep &= torch.zeros_like(keep).scatter(-1, ordered.indices, stays)
        targets = batch.input_ids[0, 1:]
        keep.scatter_(-1, targets[:, None], True)  # the sampled token is always in support
        expected = scaled.masked_fill(~keep, float("-inf")).log_softmax(-1)
        expected = expected.gather(-1, targets[:, None]).squeeze(-1)
        plain = token_logprobs(logits, batch.input_ids, batch.temperatures)
    n = len(row.tokens)
    assert torch.allclose(got[0, 1:n], expected[: n - 1], atol=1e-5)
    assert bool((got[0, 1:n] > plain[0, 1:n]).all())  # renormalised over fewer tokens
