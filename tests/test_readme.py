"""The README runs as written: every Python snippet is executed (in a folder where
`runs/compare-cpu/runs/tngram-s0`, the demo's TN-gram run, is a tiny trained run), every TOML
snippet is loaded as a config file, and every shell command line is parsed by the CLI (flags, choices, recipe names and --set keys checked; the cheap
`--print-config` / `--config` pair is run for real). The docs stand alone (no paths outside the
repository, no issue numbers), and LICENSE / CITATION.cff match pyproject and the README."""

from __future__ import annotations

from research.cli import main as research_main
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
    """A folder holding a tiny TN-gram run (2 steps) where `make demo` puts its TN-gram run, which
    the README's load_run snippet opens."""
    from test_train_support import single_thread
    from tngram.train.loop import train
    root = tmp_path_factory.mktemp("readme")
    with single_thread():
        train(tiny_config(tiny_data, extra=["schedule.steps=2", "run.val_every=0", "run.checkpoint_every=0"]),
              root / "runs" / "compare-cpu" / "runs" / "tngram-s0", progress=False)
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
    from tngram.train.recipes import resolve_config
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
    from tngram.cli.main import build_parser, main
    from tngram.train.recipes import resolve_config
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
    from tngram.train.recipes import get_recipe, param_summary
    rows = _table(README, "| recipe | backbone |")
    assert len(rows) >= 6
    for row in rows:
        s = param_summary(get_recipe(row[0].strip("`")))
        assert row[3] == f"{s['total_params']:,}", row
        assert row[4] == ("–" if s["delta_params"] == 0 else f"{s['delta_params']:,}"), row


@pytest.mark.parametrize("path", [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "research").glob("*.md")), ids=lambda p: p.name)
def test_generated_results_blocks_equal_their_results_files(path):
    """Every generated table (research/PERFORMANCE.md's and research/RESULTS.md's, the demo's included)
    is `python -m research report doc`'s rendering of the results file it cites."""
    from tngram.cli import main
    from research.report.docblocks import block_names
    names = block_names(path.read_text())
    if path.name == "RESULTS.md":    # the README links here instead of carrying tables
        assert {"demo-compare-cpu", "pareto-best-params", "pareto-best-step"} <= set(names)
    if path.name == "PERFORMANCE.md":
        assert {"bench-threads-8a1a1d7:candidates", "bench-threads-8a1a1d7:targets"} <= set(names)
    assert research_main(["report", "doc", "--check", str(path)]) == 0


def test_report_readme_regenerates_the_block(tmp_path):
    import json

    from tngram.cli import main
    from research.report.readme import BLOCK, current_block
    snap = json.loads((ROOT / "research/results/demo-compare-cpu.json").read_text())
    # a compare folder holding the snapshot's rows, with one number changed
    d = tmp_path / "cmp"
    rows = [dict(r, run_dir=f"runs/{r['method']}-s0") for r in snap["rows"]]
    rows[0]["val_bpb"] = 9.8765
    (d).mkdir()
    (d / "results.json").write_text(json.dumps({"preset": snap["preset"], "seeds": snap["seeds"], "rows": rows}))
    (tmp_path / "research" / "results").mkdir(parents=True)
    readme = tmp_path / "research" / "RESULTS.md"              # where the demo's table lives
    shutil.copy(ROOT / "research" / "RESULTS.md", readme)
    for f in (ROOT / "research/results").glob("*.json"):   # the doc's other generated blocks cite these
        if f.name != "demo-compare-cpu.json":
            shutil.copy(f, tmp_path / "research/results/")
    assert research_main(["report", "readme", str(d), "--readme", str(readme)]) == 0
    block = current_block(readme.read_text(), BLOCK)
    assert "9.8765" in block and "research/results/demo-compare-cpu.json" in block
    assert research_main(["report", "readme", "--check", "--readme", str(readme)]) == 0
    readme.write_text(readme.read_text().replace("9.8765", "9.8766"))
    assert research_main(["report", "readme", "--check", "--readme", str(readme)]) == 1


DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "research").glob("*.md"))


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


def test_command_lines_in_docs_parse():
    """Every `tngram COMMAND ...` line in a code block of docs/*.md still parses (stale flags such
    as a renamed option fail here). Usage synopses (with [optional] parts) and output lines whose
    first word is not a command are skipped."""
    from tngram.cli.main import build_parser
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction)).choices
    bad, n = [], 0
    for f in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"```[a-z]*\n(.*?)```", f.read_text(encoding="utf-8"), flags=re.S):
            for line in block.splitlines():
                for part in line.split(" #")[0].split(" ; "):
                    m = re.search(r"(?:^|\s)tngram\s+(.*)$", part.strip())
                    if not m or " [" in part:
                        continue
                    try:
                        argv = shlex.split(m.group(1))
                    except ValueError:
                        continue
                    if not argv or argv[0] not in commands:
                        continue
                    n += 1
                    try:
                        with contextlib.redirect_stderr(io.StringIO()):
                            parser.parse_args(argv)
                    except SystemExit:
                        bad.append(f"{f.name}: tngram {m.group(1)}")
    assert n >= 10 and not bad, bad


@pytest.mark.parametrize("kind", ["tngram", "engram"])
def test_readme_claim_memory_is_a_no_op_at_step_0(kind):
    """README "Training the memory in your own model": with the default init, a GPT with a memory
    gives the raw GPT's logits at step 0, the value projection gets a gradient at the first step
    and the tables/factors do not (their gradient passes through the zero value projection)."""
    import torch
    from dataclasses import replace

    from test_gpt import TINY, tiny_memories
    from tngram.model.gpt import GPT
    from tngram.optim.groups import split_memory_params
    mem = tiny_memories()[kind]
    mem = replace(mem, zero_init_value=True, zero_init_conv=True)    # the defaults
    torch.manual_seed(0)
    raw = GPT(TINY)
    torch.manual_seed(0)
    m = GPT(replace(TINY, memory=mem))
    for model in (raw, m):          # the backbone's zero-initialised projections: non-trivial outputs
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if p.dim() == 2 and p.abs().sum() == 0 and "memory" not in name and "value_proj" not in name:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids = torch.randint(1, 50, (2, 16))
    torch.testing.assert_close(m(ids), raw(ids), rtol=0, atol=1e-6)   # the memory adds an exact 0
    m(ids[:, :-1], ids[:, 1:]).backward()
    tables, _ = split_memory_params(m)
    assert tables and all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in tables)
    vproj = [p for n, p in m.named_parameters() if n.endswith("value_proj.weight")]
    assert vproj and all(torch.count_nonzero(p.grad) > 0 for p in vproj)


def test_block_names_may_name_a_vocabulary_setting():
    """A results file of a corpus at another vocabulary is named NAME@V (pareto-default@8192): its
    block is found, so `report doc --check` compares it like any other."""
    from research.report.markdown import block_names
    text = "<!-- BEGIN generated: pareto-default@8192 -->\nx\n<!-- END generated: pareto-default@8192 -->\n"
    assert block_names(text) == ["pareto-default@8192"]
