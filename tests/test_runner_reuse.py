"""A finished run stays reusable when the config gains a field whose default keeps old behaviour."""

from __future__ import annotations

import json
from dataclasses import replace

from tngram.experiments.runner import is_complete
from tngram.train.recipes import get_recipe


def test_run_saved_before_a_new_field_is_still_complete(tmp_path):
    cfg = get_recipe("mini-tngram")
    saved = cfg.to_dict()
    del saved["model"]["memory"]["kernel_size"]   # as if these had been added after the run
    del saved["run"]["init_from"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    (tmp_path / "summary.json").write_text("{}")
    assert is_complete(tmp_path, cfg)             # recipe value 3 = the field's default
    wide = replace(cfg, model=replace(cfg.model, memory=replace(cfg.model.memory, kernel_size=4)))
    assert not is_complete(tmp_path, wide)        # a non-default value is not assumed
    saved["optim"]["matrix_lr"] = 0.5             # a changed value is never reused
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert not is_complete(tmp_path, cfg)
