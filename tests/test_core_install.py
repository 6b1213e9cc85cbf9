"""A core install (no `report` extra): tngram imports and trains without matplotlib and scipy, and
whatever needs them says which extra to install. The missing packages are simulated in a fresh
interpreter by a meta-path finder that refuses to import them (as if they were not installed)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from test_train_support import one_thread, tiny_data  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("matplotlib", "scipy")

CHILD = r'''
import sys, json
from pathlib import Path
BLOCKED = {blocked!r}

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"No module named {{name!r}} (blocked: core install)")
        return None

sys.meta_path.insert(0, Blocker())
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import tngram
from test_train_support import tiny_config
from tngram.train.loop import train
s = train(tiny_config(Path({data!r}), extra=["schedule.steps=3", "run.val_every=0", "run.checkpoint_every=0"]),
          Path({out!r}) / "run", progress=False)
from tngram.common import MissingExtraError
from tngram.report.compare import write_compare_report
msgs = []
for fn in (lambda: __import__("tngram.report.plots", fromlist=["x"]).pyplot(),
           lambda: __import__("tngram.report.stats", fromlist=["x"]).paired_stats([0.1, -0.2, 0.3])):
    try:
        fn()
    except MissingExtraError as e:
        msgs.append(str(e))
rows = [dict(method=m, seed=sd, delta_params=0, train_loss=3.0 + sd, val_loss=3.0 + sd / 10 + i / 100,
             val_bpb=1.5, tokens_per_s=1.0, run_dir="x") for sd in (0, 1) for i, m in enumerate(("engram", "tngram"))]
(Path({out!r}) / "cmp").mkdir()
write_compare_report(Path({out!r}) / "cmp", dict(preset="cpu", data="d", rows=rows))
print(json.dumps(dict(steps=s["steps"], loss=s["train_loss"], msgs=msgs,
                      loaded=sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED),
                      report=(Path({out!r}) / "cmp" / "report.md").read_text())))
'''


def test_pyproject_core_dependencies_leave_out_the_report_extra():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(meta["dependencies"])
    assert not any(b in core for b in BLOCKED)
    assert sorted(d.split(">")[0] for d in meta["optional-dependencies"]["report"]) == ["matplotlib", "scipy"]


def test_core_install_imports_and_trains_without_matplotlib_and_scipy(tiny_data, tmp_path):  # noqa: F811
    import json
    code = CHILD.format(blocked=BLOCKED, tests=str(ROOT / "tests"), data=str(tiny_data), out=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(Path.home())})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["steps"] == 3 and res["loss"] > 0
    assert res["loaded"] == []                          # nothing of matplotlib/scipy got imported
    assert res["msgs"] == ["figures need matplotlib, which is not installed: pip install 'tngram[report]'",
                           "confidence intervals need scipy, which is not installed: pip install 'tngram[report]'"]
    # compare still writes its table, and says what the figure and the significance table need
    assert "| TN-gram |" in res["report"]
    assert "No figure: figures need matplotlib" in res["report"]
    assert "No significance table: " in res["report"] and "tngram[report]" in res["report"]


def test_experiment_without_the_report_extra_stops_before_training(tmp_path):
    code = ("import sys\n"
            "class B:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name.split('.')[0] in {BLOCKED!r}:\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, B())\n"
            "from research.cli import main\n"
            f"sys.exit(main(['experiment', 'ngram-order', '--out', {str(tmp_path / 'exp')!r}]))\n")
    root = str(Path(__file__).resolve().parents[1])  # the lab runs from a clone's root
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(Path.home()),
                            "PYTHONPATH": root})
    assert r.returncode == 2
    assert r.stderr.strip() == ("tngram: error: `python -m research experiment` figures need matplotlib, which is not "
                                "installed: pip install 'tngram[report]'")
    assert not (tmp_path / "exp").exists()


def test_readme_extras_table_lists_every_extra_with_its_packages():
    import re
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([\w-]+)` \| ([^|]+) \|", readme.split("| extra | installs | needed for |", 1)[1].split("\n\n", 1)[0],
                           flags=re.M))
    assert set(rows) == set(meta), (sorted(rows), sorted(meta))
    for extra, reqs in meta.items():
        names = {re.split(r"[\[<>=!~ ]", r, 1)[0].lower() for r in reqs}
        listed = {n.strip().lower() for n in rows[extra].split(",")}
        assert names == listed, (extra, names, listed)
