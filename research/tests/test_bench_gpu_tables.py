"""The tables section of `python -m research bench gpu` (research.bench.gpu_tables): the candidates of one
vocabulary packed into groups that fit the free memory and timed interleaved, at tiny shapes on
the CPU."""

import json
import weakref

import pytest
import torch

from research.bench import gpu_parts, gpu_tables
from research.bench.gpu import shapes_for
from research.cli import main

from test_train_support import one_thread  # noqa: F401


def test_pack_keeps_order_and_fits_each_group():
    # sums within the room: 3 + 3 = 6 <= 7, a third 3 would make 9
    assert gpu_tables.pack([3.0, 3.0, 3.0], 7.0) == [[0, 1], [2]]
    # a need above the room stands alone; the next ones start a new group
    assert gpu_tables.pack([10.0, 1.0, 1.0], 5.0) == [[0], [1, 2]]
    # free memory unknown: nothing is assumed to fit together
    assert gpu_tables.pack([1.0, 1.0], None) == [[0], [1]]
    assert gpu_tables.pack([], 5.0) == []


def test_interleaved_rounds_rotate_and_time_every_candidate():
    """gpu_parts.interleaved_ms (the timer of the kernels, attention, optim and tables sections).
    Warm-up: every candidate in order; round r then starts at candidate r mod n, so each one is
    timed `reps` times and none always follows the same other."""
    calls = []
    steps = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    out = gpu_parts.interleaved_ms(steps, reps=3, warmup=1, dev="cpu")
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
    for k in "abc":
        assert (
            out[k]["reps"] == 3 and 0 <= out[k]["min_ms"] <= out[k]["median_ms"] <= out[k]["max_ms"]
        )


def test_candidates_in_the_files_order():
    keys = [c.key for c in gpu_tables.candidates(300)]
    assert keys == ["raw@300"] + [
        f"{m}@300/{u}" for m in ("engram", "tngram") for u in ("dense", "sparse", "rowwise")
    ]


def test_plan_groups_what_fits_the_free_memory(monkeypatch):
    """Free memory = the activation reserve + raw's and Engram dense's needs (each counted on the
    meta device): raw and Engram dense are timed together, and each later candidate, whose need
    is at least raw's, starts a group; a candidate too big even alone is skipped and named."""
    shapes = shapes_for("cpu", reps=1)
    V = 4096
    need = {m: gpu_parts.table_step_need(m, V, shapes)[1] for m in ("raw", "engram", "tngram")}
    reserve = gpu_tables.activation_reserve_gib(V, shapes)
    # tiny shapes: 2 x 64 tokens; 16 bytes per token and vocabulary entry, plus 1 GiB
    assert reserve == pytest.approx(2 * 64 * V * 16 / 2**30 + 1.0)
    room = need["raw"] + need["engram"]
    assert need["tngram"] + need["engram"] > room and 2 * need["tngram"] > room
    monkeypatch.setattr(gpu_parts, "free_gib", lambda dev: reserve + room * (1 + 1e-9))
    plan = [([c.key for c in g], why) for g, why in gpu_tables.plan(V, shapes)]
    assert plan[0] == ([f"raw@{V}", f"engram@{V}/dense"], "")
    assert [keys for keys, _ in plan[1:]] == [
        [f"engram@{V}/{u}"] for u in ("sparse", "rowwise")
    ] + [[f"tngram@{V}/{u}"] for u in ("dense", "sparse", "rowwise")]
    # free memory between raw's need and the smaller memory's: raw alone, every memory step
    # skipped with the reason, in the file's order
    small = min(need["engram"], need["tngram"])
    assert need["raw"] < small
    monkeypatch.setattr(gpu_parts, "free_gib", lambda dev: (need["raw"] + small) / 2)
    plan = [([c.key for c in g], why) for g, why in gpu_tables.plan(V, shapes)]
    assert plan[0] == ([f"raw@{V}"], "")
    assert [keys for keys, _ in plan[1:]] == [[k] for k in keys_at(V)[1:]]
    assert all(why.startswith("memory: needs") for _, why in plan[1:])


def keys_at(V):
    return [c.key for c in gpu_tables.candidates(V)]


def test_a_group_out_of_memory_is_rerun_one_at_a_time(monkeypatch, one_thread):  # noqa: F811
    """A fake card that holds one built step at a time: building a second raises torch's
    out-of-memory error. The group is freed (its steps are gone before the retry builds again)
    and each candidate is timed alone, marked so, without "interleaved_with"."""
    real = gpu_parts.table_setup
    live: weakref.WeakSet = weakref.WeakSet()

    class Step:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self):
            self.fn()

    def one_at_a_time(model, V, update, shapes):
        if len(live) > 0:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
        fn, facts = real(model, V, update, shapes)
        step = Step(fn)
        live.add(step)
        return step, facts

    monkeypatch.setattr(gpu_parts, "table_setup", one_at_a_time)
    shapes = shapes_for("cpu", reps=1)
    group = gpu_tables.candidates(128)[:3]
    out = gpu_tables.time_group(group, shapes)
    assert list(out) == [c.key for c in group]
    for r in out.values():
        assert r["median_ms"] > 0 and r["alone_after_oom"] is True and "interleaved_with" not in r


def test_budget_times_a_prefix_of_a_group_interleaved(tmp_path, one_thread):  # noqa: F811
    """A time budget for only part of V's group: the longest prefix that fits is timed (each of
    it interleaved with the others of it), the rest is skipped for the budget."""
    out = tmp_path / "t.json"
    rc = main(
        [
            "bench",
            "gpu",
            "--out",
            str(out),
            "--sections",
            "tables",
            "--vocabs",
            "128",
            "--recipes",
            "paper-l9-raw",
            "--budget",
            "2.4",
        ]
    )
    assert rc == 0
    tab = json.loads(out.read_text())["sections"]["tables"]
    keys = [c.key for c in gpu_tables.candidates(128)]
    assert list(tab) == keys
    timed = [k for k in keys if "median_ms" in tab[k]]
    assert 1 <= len(timed) < len(keys) and timed == keys[: len(timed)]  # 0.5 s each at tiny shapes
    for k in timed:
        assert sorted(tab[k].get("interleaved_with", [])) == sorted(set(timed) - {k})
    for k in keys[len(timed) :]:
        assert tab[k]["skipped"].startswith("time budget")


def test_the_tables_block_says_how_the_steps_were_timed():
    """The rendered tables name the groups timed together, the batches and what was timed alone;
    a file from before (no "interleaved_with") gets no such line."""
    from research.report.gpu_blocks import tables_table

    it = {"median_ms": 10.0, "min_ms": 9.0, "max_ms": 11.0, "reps": 10, "batches": 4}
    sec = {
        "raw@1024": dict(it, interleaved_with=["engram@1024/dense"]),
        "engram@1024/dense": dict(it, interleaved_with=["raw@1024"]),
        "engram@1024/sparse": dict(it, alone_after_oom=True),
        "tngram@1024/dense": dict(it, interleaved_with=["tngram@1024/sparse"]),
        "tngram@1024/sparse": dict(it, interleaved_with=["tngram@1024/dense"]),
    }
    snap = {"sections": {"tables": sec}, "shapes": {"table_batch": 16, "vocabs": [1024]}}
    assert tables_table(snap).endswith(
        "\n\nTimed interleaved in one process (every step of a group in turn, round after round; "
        "each step reads the next of its 4 batches), in these groups: raw@1024, "
        "engram@1024/dense; tngram@1024/dense, tngram@1024/sparse. Timed alone: "
        "engram@1024/sparse. Out of memory together, re-timed alone: engram@1024/sparse."
    )
    old = {k: {n: x for n, x in v.items() if n in ("median_ms", "reps")} for k, v in sec.items()}
    assert "Timed interleaved" not in tables_table(dict(snap, sections={"tables": old}))
