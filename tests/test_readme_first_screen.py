"""The README's first screen: the two set-up commands and a code block within its first 60 lines,
and a "Which memory should I use?" answer whose every command runs (`tngram train ...
--print-config`, exit 0) and trains the map's point it names: the tuned Engram and `tngram-hsum`
configs of research/experiments/pareto.py, and the raw GPT beside them."""

from __future__ import annotations

import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _commands(text: str) -> list[list[str]]:
    """argv (after `tngram`) of every command line in the bash blocks of `text`."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("tngram "):
                out.append(shlex.split(line)[1:])
    return out


def test_first_60_lines_hold_the_setup_commands_and_a_code_block():
    head = "\n".join(README.splitlines()[:60])
    setup = re.search(r"```bash\n(.*?)```", head, flags=re.S)
    assert setup, "no bash block in the first 60 lines"
    lines = [ln.split("#")[0].strip() for ln in setup.group(1).splitlines()]
    assert lines == ["make demo", "make test"]
    assert re.search(r"```python\n(.+?)```", head, flags=re.S), "no Python block in 60 lines"
    assert "## Which memory should I use?" in head


def _resolved(argv: list[str]):
    from tngram.cli.main import build_parser
    from tngram.train.recipes import resolve_config

    args = build_parser().parse_args(argv)
    return resolve_config(args.recipe, args.overrides, args.data, args.config, args.steps)


def test_every_which_memory_command_prints_its_config(capsys, tmp_path, monkeypatch):
    from tngram.cli.main import main

    monkeypatch.chdir(tmp_path)
    cmds = _commands(_section("Which memory should I use?"))
    assert len(cmds) >= 3 and all(c[0] == "train" for c in cmds)
    for argv in cmds:
        assert main(argv + ["--print-config"]) == 0, argv
        out = capsys.readouterr().out
        assert f'recipe = "{argv[1]}"' in out or argv[1] in out
    assert not (tmp_path / "runs").exists()            # --print-config trains nothing


def test_which_memory_commands_train_the_points_the_answer_names(monkeypatch):
    """The recommended recipe, the tuned Engram it was paired with and the Engram of the "= total
    parameters" view are, apart from the run's name, the map's `tngram-hsum` 3929 point, its
    Engram 3800 point and the iso view's Engram 400 point (MLP narrowed by
    pareto_iso.iso_backbone), each at its tuned table lr; the V 8192 command is the map's
    `tngram-hsum` 94547 point there, and the V 32768 one the pair of vocab_regime's queues q3-q5
    that the row names (its dataset folder aside); the README names the recipe and the tables'
    label of its family, and each command is the one its results file records."""
    import json

    from research.experiments import pareto as P
    from research.experiments import vocab_regime as VR
    from tngram.experiments.common import base_recipe
    from research.experiments.pareto_report import LABELS

    text = _section("Which memory should I use?")
    bases = {m: base_recipe("mini", m) for m in P.METHODS}
    by_out = {argv[argv.index("--out") + 1]: _resolved(argv) for argv in _commands(text)}
    i = P.CONFIRM["size_indices"][0]                    # the screened size (4.3 M)
    monkeypatch.setattr(VR, "corpus_data", lambda corpus: ("", int(corpus.split("@")[1])))
    v8k = {m: replace(b, model=replace(b.model, vocab_size=8192)) for m, b in bases.items()}
    points = {
        "runs/hsum": P.with_table_lr(
            P.family_config("tngram-hsum", P.SIZES["tngram-hsum"][2][i], bases),
            P.TUNED_DEFAULT["tngram-hsum"]),
        "runs/engram-tuned": P.with_table_lr(
            P.family_config("engram", P.SIZES["engram"][2][i], bases), P.TUNED_DEFAULT["engram"]),
        "runs/engram-iso": P.with_table_lr(  # the largest ISO_SIZES point, as view_specs builds it
            P.iso_config("engram", P.ISO_SIZES["engram"][2][-1], bases), P.TUNED_DEFAULT["engram"]),
        "runs/hsum-8192": P.with_table_lr(
            P.family_config("tngram-hsum", 94547, v8k), P.TUNED_DEFAULT["tngram-hsum"]),
        "runs/hsum-32768": VR.hsum("default@32768", VR.HSUM_BUDGET),
        "runs/engram-32768": VR.engram_at(
            "default@32768", VR.delta(VR.hsum("default@32768", VR.HSUM_BUDGET)))[0],
    }
    recorded = json.loads((ROOT / "research/results/which-memory.json").read_text())["commands"]
    assert set(by_out) == set(recorded) <= set(points)   # one command per row, each a known point
    points = {out: points[out] for out in by_out}
    for out, cmd in recorded.items():
        assert cmd + f" --out {out}" in text, out
    for out, point in points.items():
        got = by_out[out]
        got = replace(got, name=point.name, data=replace(got.data, dir=point.data.dir))
        assert got.to_dict() == point.to_dict(), out
    assert f"**`{P.CONFIRM['family'].replace('tngram', 'mini-tngram')}`**" in text   # the winner
    assert f'"{LABELS[P.CONFIRM["family"]]}"' in text      # ... and its family's label in tables
    assert LABELS[P.CONFIRM["baseline"]] in text and "tuned Engram" in text


@pytest.mark.parametrize("limit", [250])
def test_readme_stays_short(limit):
    assert len(README.splitlines()) <= limit
