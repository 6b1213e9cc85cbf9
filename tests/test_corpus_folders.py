"""`--corpora` takes dataset folders beside the built-in corpora (a user's own text, built with
`tngram data build --from-text TEXT --out DIR`): the folder's name names its runs, tags and
results files; its manifest gives the vocabulary; bad entries are one line with exit status 2
before any data or training work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_hostile import cli, one_line_exit_2  # noqa: F401
from test_train_support import tiny_data  # noqa: F401  (session fixture)
from tngram.common import TngramError
from research.experiments.common import check_corpora, corpus_data, corpus_name


def _link(tmp_path: Path, target: Path, *parts: str) -> Path:
    p = tmp_path.joinpath(*parts)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.symlink_to(target, target_is_directory=True)
    return p


def test_a_dataset_folder_is_named_by_its_folder_and_read_from_its_manifest(tiny_data, tmp_path):  # noqa: F811
    link = _link(tmp_path, tiny_data, "my.corpus_1")
    vocab = json.loads((tiny_data / "manifest.json").read_text())["vocab_size"]
    assert check_corpora(["default", str(link)]) == ["default", str(link)]
    assert corpus_name(str(link)) == "my.corpus_1"
    assert corpus_name(str(link) + "/") == "my.corpus_1"
    assert corpus_name(str(tmp_path / "x" / ".." / "my.corpus_1")) == "my.corpus_1"
    assert corpus_data(str(link)) == (str(link), vocab)  # the link as given, absolute
    assert corpus_name("default") == "default" and corpus_name("default@8192") == "default@8192"
    at = _link(tmp_path, tiny_data, "user@host", "mine")  # only the folder's own name is checked
    assert check_corpora([str(at)]) == [str(at)] and corpus_name(str(at)) == "mine"


def test_pareto_specs_of_a_dataset_folder(tiny_data, tmp_path):  # noqa: F811
    """The pareto command's specs on a folder: labels, tags and each config's data point at it."""
    from research.experiments import pareto as P

    link = _link(tmp_path, tiny_data, "mine")
    vocab = json.loads((tiny_data / "manifest.json").read_text())["vocab_size"]
    factors = dict(P.TUNED_DEFAULT, oe=2.0, longcat=2.0)
    specs = P.specs_for([str(link)], "mini", 1, None, factors, families=("raw", "engram"), n_sizes=1)
    specs += P.view_specs([str(link)], "mini", 1, None, factors, n_sizes=1)
    assert len(specs) == 2 + len(P.TOKEN_SIZES) + sum(len(v[2]) for v in P.ISO_SIZES.values())
    assert all(s.label.startswith("mine-") and s.tags["corpus"] == "mine" for s in specs)
    assert {s.config.data.dir for s in specs} == {str(link)}
    assert {s.config.model.vocab_size for s in specs} == {vocab}


def test_check_corpora_refusals(tiny_data, tmp_path):  # noqa: F811
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ([str(tmp_path / "nope")], "neither a built-in corpus"),
        (["defualt"], "neither a built-in corpus"),
        ([str(empty)], "manifest.json is missing"),
        ([str(_link(tmp_path, tiny_data, "one", "same")), str(_link(tmp_path, tiny_data, "two", "same"))],
         "two corpora would be named 'same'"),
        (["code", str(_link(tmp_path, tiny_data, "three", "code"))], "two corpora would be named 'code'"),
        ([str(_link(tmp_path, tiny_data, "with space"))], "needs a name of letters"),
        ([], "no corpus given"),
    ]
    for corpora, needle in cases:
        with pytest.raises(TngramError, match=needle):
            check_corpora(corpora)


@pytest.mark.parametrize("name", ["pareto", "corpora", "table-update"])
def test_a_bad_corpus_folder_is_one_line_before_any_work(name, tmp_path, capsys):
    out = tmp_path / "o"
    bad = tmp_path / "not-a-dataset"
    bad.mkdir()
    rc, err = cli(["experiment", name, "--corpora", f"default,{bad}", "--out", str(out)], capsys)
    one_line_exit_2(rc, err)
    assert "--corpora" in err and "manifest.json is missing" in err and not out.exists()
