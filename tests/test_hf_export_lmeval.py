"""lm-evaluation-harness (`--model hf`) on an exported run and a small local task.

`make test` installs lm-eval (the `lmeval` extra); elsewhere this test skips when it is not
installed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install \"lm-eval[hf]\"); `make test` installs it")
pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate (pip install \"lm-eval[hf]\")")

from test_hf_export import tiny_run  # noqa: E402
from test_train_support import one_thread, tiny_data  # noqa: F401,E402
from tngram.cli import main  # noqa: E402
from tngram.hf.lmeval import evaluate, write_task  # noqa: E402

DOCS = [
    {"context": "Kalo mine", "choices": ["ru ta", "zen qua", "ka lo"], "label": 0},
    {"context": "Galmon ber", "choices": ["si de", "an el"], "label": 1},
    {"context": "Ta po si", "choices": ["mon", "qua", "ith"], "label": 2},
    {"context": "Vo an el or", "choices": ["us ith", "ber gal"], "label": 0},
    {"context": "Mi ne ru", "choices": ["ta po", "de vo", "an"], "label": 1},
    {"context": "Zen qua", "choices": ["ka", "lo mi"], "label": 1},
]


def independent_accuracy(model, sp) -> float:
    """argmax over choices of sum log p(continuation | <s> context), continuation = the tokens of
    '<s>' + context + ' ' + choice after those of '<s>' + context (lm-eval's pairing)."""
    hits = 0
    with torch.no_grad():
        for d in DOCS:
            ctx = [1] + sp.encode(d["context"])
            scores = []
            for c in d["choices"]:
                whole = [1] + sp.encode(d["context"] + " " + c)
                cont = whole[len(ctx):]
                logp = torch.log_softmax(model(torch.tensor([whole]))[0, :-1].double(), -1)
                idx = torch.arange(len(whole) - len(cont) - 1, len(whole) - 1)
                scores.append(float(logp[idx, torch.tensor(cont)].sum()))
            hits += int(max(range(len(scores)), key=scores.__getitem__) == d["label"])
    return hits / len(DOCS)


def test_lm_eval_hf_model_on_a_local_task(tiny_data, tmp_path, monkeypatch):
    import sentencepiece as spm
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, model = tiny_run(tmp_path / "runs", "mini-tngram", tiny_data)
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    write_task(tmp_path / "tasks", "tngram_tiny_mc", DOCS)
    res = evaluate(tmp_path / "hf", tmp_path / "tasks", "tngram_tiny_mc", batch_size=4)
    acc = res["results"]["tngram_tiny_mc"]["acc,none"]
    sp = spm.SentencePieceProcessor(model_file=str(tiny_data / "tokenizer.model"))
    assert acc == pytest.approx(independent_accuracy(model, sp))


def test_lm_eval_generate_until_left_padded_batches(tiny_data, tmp_path, monkeypatch):
    """lm-eval's generate_until batches prompts with left padding: every answer equals greedy
    decoding of its prompt alone with our GPT (argmax over full recomputation)."""
    import sentencepiece as spm
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, model = tiny_run(tmp_path / "runs", "mini-engram", tiny_data)
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    lm = HFLM(pretrained=str(tmp_path / "hf"), batch_size=3, device="cpu", dtype="float32",
              add_bos_token=True)
    prompts = ["Kalo mine ru ta", "Zen", "Galmon ber si de an"]
    gen = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
    reqs = [Instance(request_type="generate_until", doc={}, arguments=(p, gen), idx=i)
            for i, p in enumerate(prompts)]
    answers = lm.generate_until(reqs)
    sp = spm.SentencePieceProcessor(model_file=str(tiny_data / "tokenizer.model"))
    for p, got in zip(prompts, answers):
        seq = torch.tensor([[1] + sp.encode(p)])
        with torch.no_grad():
            for _ in range(6):
                seq = torch.cat([seq, model(seq)[:, -1:].argmax(-1)], dim=1)
        new = seq[0, len(sp.encode(p)) + 1:].tolist()
        assert got == lm.tokenizer.decode(new, skip_special_tokens=True), (p, got)
