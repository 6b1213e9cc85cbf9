"""The README runs as written: every Python snippet is executed (in a folder where `runs/mini`
is a tiny trained run), every TOML snippet is loaded as a config file, and every shell command
line is parsed by the CLI (flags, choices, recipe names and --set keys checked; the cheap
`--print-config` / `--config` pair is run for real). The docs stand alone (no paths outside the
repository, no issue numbers), and LICENSE / CITATION.cff match pyproject and the README."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
from pathlib import Path

import pytest

from test_train_support import one_thread, tiny_config, tiny_data  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_data):  # noqa: F811
    """A folder with runs/mini: a tiny TN-gram run trained for 2 steps."""
    from test_train_support import single_thread
    from tngram.train.loop import train
    root = tmp_path_factory.mktemp("readme")
    with single_thread():
        train(tiny_config(tiny_data, extra=["schedule.steps=2", "run.val_every=0", "run.checkpoint_every=0"]),
              root / "runs" / "mini", progress=False)
    return root


def test_readme_has_snippets():
    assert len(blocks("python")) >= 4 and blocks("toml") and len(blocks("bash")) >= 3


@pytest.mark.parametrize("i", range(len(blocks("python"))))
def test_python_snippet_runs(i, project, monkeypatch, capsys):
    code = blocks("python")[i]
    monkeypatch.chdir(project)
    exec(compile(code, f"README.md python block {i + 1}", "exec"), {"__name__": "__readme__"})
    if "tngram.sample" in code:
        assert capsys.readouterr().out.startswith("The history of")


@pytest.mark.parametrize("i", range(len(blocks("toml"))))
def test_toml_snippet_is_a_valid_config(i, tmp_path):
    from tngram.train.cli import resolve_config
    f = tmp_path / "c.toml"
    f.write_text(blocks("toml")[i])
    cfg = resolve_config(None, [], config_file=str(f))
    assert cfg.schedule.steps == 200 and cfg.model.memory.kind == "tngram"


def _command_lines() -> list[str]:
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            for part in line.split(" ; "):
                part = part.strip()
                if part.startswith(("tngram ", "torchrun ")):
                    out.append(part)
    return out


def test_every_shell_command_parses(tmp_path, monkeypatch, capsys):
    from tngram.cli import build_parser, main
    from tngram.train.cli import resolve_config
    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    lines = _command_lines()
    assert len(lines) >= 15
    for line in lines:
        argv = shlex.split(line)
        if argv[0] == "torchrun":
            argv = ["train"] + argv[argv.index("tngram.train") + 1:]
        else:
            argv = argv[1:]
        redirect = None
        if ">" in argv:
            redirect = argv[argv.index(">") + 1]
            argv = argv[:argv.index(">")]
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:
            raise AssertionError(f"README command does not parse: {line}") from e
        if args.command == "train":
            if redirect:   # run it: --print-config is cheap
                assert main(argv) == 0
                Path(redirect).write_text(capsys.readouterr().out)
            resolve_config(args.recipe, args.overrides, args.data, args.config, args.steps)
        if args.command == "params":
            with contextlib.redirect_stdout(io.StringIO()):
                assert args.func(args) == 0


def _table(text: str, header_start: str) -> list[list[str]]:
    lines = text.split(header_start, 1)[1].split("\n\n", 1)[0].splitlines()
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines[2:]]


def test_parameter_table_equals_param_summary():
    from tngram.recipes import get_recipe, param_summary
    rows = _table(README, "| recipe | backbone |")
    assert len(rows) >= 6
    for row in rows:
        s = param_summary(get_recipe(row[0].strip("`")))
        assert row[3] == f"{s['total_params']:,}", row
        assert row[4] == ("–" if s["delta_params"] == 0 else f"{s['delta_params']:,}"), row


def test_generated_results_block_equals_its_results_file():
    """The README's demo table is `tngram report readme`'s rendering of the file it cites."""
    from tngram.cli import main
    assert main(["report", "readme", "--check", "--readme", str(ROOT / "README.md")]) == 0


def test_report_readme_regenerates_the_block(tmp_path):
    import json

    from tngram.cli import main
    from tngram.report.readme import BLOCK, current_block
    snap = json.loads((ROOT / "docs/results/demo-compare-cpu.json").read_text())
    # a compare folder holding the snapshot's rows, with one number changed
    d = tmp_path / "cmp"
    rows = [dict(r, run_dir=f"runs/{r['method']}-s0") for r in snap["rows"]]
    rows[0]["val_bpb"] = 9.8765
    (d).mkdir()
    (d / "results.json").write_text(json.dumps({"preset": snap["preset"], "seeds": snap["seeds"], "rows": rows}))
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    assert main(["report", "readme", str(d), "--readme", str(readme)]) == 0
    block = current_block(readme.read_text(), BLOCK)
    assert "9.8765" in block and "docs/results/demo-compare-cpu.json" in block
    assert main(["report", "readme", "--check", "--readme", str(readme)]) == 0
    readme.write_text(readme.read_text().replace("9.8765", "9.8766"))
    assert main(["report", "readme", "--check", "--readme", str(readme)]) == 1


DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_docs_stand_alone(path):
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"\.\./|shared/(paper|research)|/work/", text), path
    assert not re.search(r"\b[Ii]ssues? \d+\b", text), path       # our issue tracker is not public


def test_license_and_citation_match():
    import tomllib

    import yaml
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "MIT" and (ROOT / "LICENSE").read_text().startswith("MIT License")
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["license"] == "MIT" and cff["version"] == meta["version"]
    paper = cff["preferred-citation"]
    assert paper["title"] in README and str(paper["year"]) in README and "ICML" in README
    bib = re.search(r"author\s*=\s*\{(.*)\},", README).group(1)
    assert bib == " and ".join(f"{a['family-names']}, {a['given-names']}" for a in paper["authors"])
