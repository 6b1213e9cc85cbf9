"""The repetition guard: a run whose schedule reads its training split more than 4 times is refused
before training, in one line that says by how much and what to do (for the paper recipes: the
FineWeb download with the shard count their tokens need), unless the user asks for repetition
(--allow-repeat or data.allow_repeat=true); then one note line says it."""

from __future__ import annotations

import json
import math

import pytest

from test_train_support import cli_args, one_thread, tiny_config, tiny_data  # noqa: F401
from tngram.cli import main
from tngram.common import TngramError
from tngram.data.build import open_dataset
from tngram.data.shards import read_shard_header
from tngram.train.health import MAX_PASSES, check_passes, fineweb_command
from tngram.train.recipes import get_recipe, resolve_config

DEFAULT_CORPUS_TRAIN_TOKENS = 5_894_426  # docs/DATA.md, the default corpus at sp1024


def train_tokens(data) -> int:
    return sum(read_shard_header(p) for p in open_dataset(data).train_files)


def steps_for(data, passes: float) -> int:
    """Steps of the tiny config (512 tokens each) that read the tiny data `passes` times."""
    return math.floor(passes * train_tokens(data) / 512)


def test_paper_recipes_on_the_default_corpus_point_at_the_fineweb_they_need():
    with pytest.raises(TngramError) as e:
        check_passes(get_recipe("paper-l9-tngram"), DEFAULT_CORPUS_TRAIN_TOKENS, "/data/default")
    msg = str(e.value)
    assert "\n" not in msg
    assert "paper-l9-tngram plans 3,145,728,000 training tokens (6,000 steps x 524,288)" in msg
    assert "/data/default holds 5,894,426: it would read them 533.7 times, more than 4" in msg
    assert "`tngram data fineweb --train-shards 32`" in msg       # 32 x 10^8 >= 3.15 x 10^9
    assert "--allow-repeat" in msg and "data.allow_repeat=true" in msg
    # L18 reads 5.2 B tokens: 53 shards; a FineWeb download that is too small is topped up
    assert fineweb_command(10_000 * 524_288, 1024) == "tngram data fineweb --train-shards 53"
    with pytest.raises(TngramError, match=r"--train-shards 32 --out /fw`"):
        check_passes(get_recipe("paper-l9-raw"), 200_000_000, "/fw", kind="fineweb")
    # no FineWeb export with this vocabulary: build a dataset instead
    cfg = resolve_config("paper-l9-raw", ["model.vocab_size=8192"])
    with pytest.raises(TngramError, match="tngram data build --from-text"):
        check_passes(cfg, DEFAULT_CORPUS_TRAIN_TOKENS, "/data/default")
    # enough FineWeb: nothing to say; asked for: a note, no error
    assert check_passes(get_recipe("paper-l9-tngram"), 3_200_000_000, "/fw") is None
    allowed = resolve_config("paper-l9-tngram", ["data.allow_repeat=true"])
    note = check_passes(allowed, DEFAULT_CORPUS_TRAIN_TOKENS, "/data/default")
    assert note.startswith("tngram: note: paper-l9-tngram plans") and "533.7 times" in note


def test_the_cpu_recipes_read_their_corpus_well_under_the_limit():
    """`make demo` and the mini recipes: 1.05 M tokens on 5.89 M, 0.18 passes."""
    for name in ("mini-raw", "mini-engram", "mini-tngram"):
        cfg = get_recipe(name)
        planned = cfg.schedule.steps * cfg.data.global_batch_tokens
        assert planned / DEFAULT_CORPUS_TRAIN_TOKENS < 0.2 < MAX_PASSES
        assert check_passes(cfg, DEFAULT_CORPUS_TRAIN_TOKENS, "/data/default") is None


def test_refused_before_training_in_one_line(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    steps = steps_for(tiny_data, 4.5)
    args = cli_args(tiny_data, "mini-tngram", out, [f"schedule.steps={steps}"])
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tngram: error: mini-tngram plans "), err
    assert "times, more than 4" in err[0] and "--allow-repeat" in err[0]
    assert "tngram data build --from-text" in err[0]                  # vocab 512: no FineWeb
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_exactly_the_limit_trains_without_a_word(tiny_data):
    cfg = tiny_config(tiny_data, extra=[f"schedule.steps={steps_for(tiny_data, MAX_PASSES)}"])
    assert check_passes(cfg, train_tokens(tiny_data), tiny_data) is None


@pytest.mark.parametrize("ask", [["--allow-repeat"], ["--set", "data.allow_repeat=true"]])
def test_asked_for_it_trains_and_says_so(ask, tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    steps = steps_for(tiny_data, 4.5)
    args = cli_args(tiny_data, "mini-tngram", out, [f"schedule.steps={steps}"])
    assert main(["train", *args, *ask, "--stop-after", "1", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    notes = [ln for ln in lines if "(data.allow_repeat=true)" in ln]
    assert len(notes) == 1 and notes[0].startswith("tngram: note: mini-tngram plans"), lines
    assert json.loads((out / "config.json").read_text())["data"]["allow_repeat"] is True


def test_config_json_omits_the_permission_when_not_given(tiny_data):
    cfg = tiny_config(tiny_data)
    assert "allow_repeat" not in cfg.to_dict()["data"]          # old config.json files match
    assert tiny_config(tiny_data, extra=["data.allow_repeat=true"]).to_dict()["data"][
        "allow_repeat"] is True


def test_compare_refuses_at_its_first_run_before_training(tiny_data, tmp_path, capfd):
    steps = math.floor(4.5 * train_tokens(tiny_data) / 4096)     # the mini recipes' global batch
    out = tmp_path / "cmp"
    argv = ["compare", "--data", str(tiny_data), "--steps", str(steps), "--out", str(out)]
    assert main(argv) == 2
    err = capfd.readouterr().err                                  # the run's own line, then ours
    assert "mini-raw plans" in err and "more than 4" in err and "--allow-repeat" in err
    assert not list(out.glob("runs/*/metrics.jsonl"))            # nothing trained
