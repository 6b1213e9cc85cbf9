"""`tngram export RUN --hf DIR`: every recipe opens with the Auto classes, logits equal ours,
generate() with the cache equals full recomputation, the tokenizer equals SentencePiece."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_train_support import TINY_VOCAB, one_thread, synthetic_documents, tiny_data  # noqa: F401,E402
from tngram.cli import main  # noqa: E402
from tngram.model.gpt import GPT  # noqa: E402
from tngram.train.recipes import get_recipe  # noqa: E402
from tngram.train.checkpoint import save_final_weights, save_run_config  # noqa: E402

RECIPES = ("mini-raw", "mini-engram", "mini-tngram", "mini-oe")


def tiny_run(root: Path, recipe: str, data_dir: Path, seed: int = 0,
             memory=None) -> tuple[Path, GPT]:
    """A run folder with random, non-zero memory weights (so every memory path affects logits);
    `memory` replaces the recipe's memory config."""
    cfg = get_recipe(recipe)
    m = cfg.model
    kw = dict(vocab_size=TINY_VOCAB, n_layer=2, n_embd=32, n_head=2, n_kv_head=1, sequence_len=64,
              memory_layers=(0, 1))
    if memory is not None:
        kw["memory"] = memory
    elif m.memory is not None:
        mem = {"tngram": dict(cp_rank=8, max_ngram=3, zero_init_value=False, zero_init_conv=False),
               "engram": dict(max_ngram=3, zero_init_value=False, zero_init_conv=False),
               "oe": dict(max_ngram=3, table_rows=300, zero_init_proj=False)}[m.memory.kind]
        kw["memory"] = replace(m.memory, **mem)
    cfg = replace(cfg, model=replace(m, **kw), data=replace(cfg.data, dir=str(data_dir)))
    torch.manual_seed(seed)
    model = GPT(cfg.model).eval()
    with torch.no_grad():   # non-trivial controls, so skips / mixes matter too
        for n, p in model.named_parameters():
            if n.endswith(("proj.weight",)) and p.abs().sum() == 0:
                p.normal_(0, 0.05)
    run = root / recipe
    run.mkdir(parents=True)
    save_run_config(run, cfg.to_dict())
    save_final_weights(run, model, 1)
    (run / "tokenizer.model").write_bytes((data_dir / "tokenizer.model").read_bytes())
    return run, model


@pytest.fixture(scope="module")
def exported(tiny_data, tmp_path_factory):
    """{recipe: (our GPT, HF dir)} exported through the CLI."""
    root = tmp_path_factory.mktemp("hf-export")
    out = {}
    for r in RECIPES:
        run, model = tiny_run(root / "runs", r, tiny_data)
        assert main(["export", str(run), "--hf", str(root / "hf" / r)]) == 0
        out[r] = (model, root / "hf" / r)
    return out


def load(hf_dir: Path):
    import tngram.hf  # noqa: F401  (registers tngram_gpt with the Auto classes)
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()


@pytest.mark.parametrize("recipe", RECIPES)
def test_logits_equal_ours_and_files_hold_no_pickle(exported, recipe):
    model, d = exported[recipe]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "tngram_gpt" and cfg["gpt"] == model.config.to_dict()
    assert "auto_map" not in cfg                        # no remote code
    assert sorted(p.name for p in d.glob("*.bin")) == [] and (d / "model.safetensors").exists()
    hf = load(d)
    assert type(hf).__name__ == "TngramGPTForCausalLM"
    for k, v in model.state_dict().items():             # every tensor and buffer, hash constants included
        assert torch.equal(hf.state_dict()["model." + k], v), k
    ids = torch.randint(0, TINY_VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
    # labels: HF's shifted mean cross-entropy = ours on (ids[:, :-1] -> ids[:, 1:])
    with torch.no_grad():
        loss = hf(ids, labels=ids).loss
        ref = torch.nn.functional.cross_entropy(ours[:, :-1].reshape(-1, TINY_VOCAB), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", RECIPES)
def test_causal_through_hf(exported, recipe):
    hf = load(exported[recipe][1])
    ids = torch.randint(0, TINY_VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))
    alt = ids.clone()
    alt[0, 17] = (alt[0, 17] + 5) % TINY_VOCAB
    with torch.no_grad():
        a, b = hf(ids).logits, hf(alt).logits
    assert torch.equal(a[:, :17], b[:, :17]) and not torch.equal(a[:, 17:], b[:, 17:])


def greedy_by_recomputation(model: GPT, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Independent reference: argmax of our GPT's full forward over the whole sequence each step."""
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return seq


def assert_export_round_trip(tmp_path: Path, data_dir: Path, memory) -> None:
    """`tngram export RUN --hf DIR` of a tiny mini-tngram run with `memory`: same tensors, same
    logits, cached greedy generation equals our full forward recomputed token by token."""
    run, model = tiny_run(tmp_path / "runs", "mini-tngram", data_dir, memory=memory)
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    hf = load(tmp_path / "hf")
    for k, v in model.state_dict().items():
        assert torch.equal(hf.state_dict()["model." + k], v), k
    ids = torch.randint(0, TINY_VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-6)
    prompt = torch.randint(3, TINY_VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    ref = greedy_by_recomputation(model, prompt, 8)
    assert torch.equal(hf.generate(prompt, do_sample=False, use_cache=True, **kw), ref)


@pytest.mark.parametrize("recipe", RECIPES)
def test_generate_with_cache_is_exact(exported, recipe):
    model, d = exported[recipe]
    hf = load(d)
    prompt = torch.randint(3, TINY_VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    ref = greedy_by_recomputation(model, prompt, 12)
    assert torch.equal(hf.generate(prompt, do_sample=False, use_cache=True, **kw), ref)
    assert torch.equal(hf.generate(prompt, do_sample=False, use_cache=False, **kw), ref)
    beam = [hf.generate(prompt, do_sample=False, num_beams=3, use_cache=c, **kw) for c in (True, False)]
    assert torch.equal(beam[0], beam[1])
    samples = []
    for c in (True, False):
        torch.manual_seed(7)
        samples.append(hf.generate(prompt, do_sample=True, top_k=0, num_return_sequences=2, use_cache=c, **kw))
    assert torch.equal(samples[0], samples[1])


def test_tokenizer_matches_sentencepiece(exported, tiny_data):
    import sentencepiece as spm
    from transformers import AutoTokenizer
    sp = spm.SentencePieceProcessor(model_file=str(tiny_data / "tokenizer.model"))
    tok = AutoTokenizer.from_pretrained(str(exported["mini-raw"][1]))
    texts = synthetic_documents()[:12] + [
        "", "Kalo  mine\tru\n\nta  ", "  leading and trailing  ", "ﬁ ① ｆｕｌｌ width", "emoji 😀 中文 ß",
        "digits 12345 and 3.14159", "Zenqua. Galmon, ber!"]
    for t in texts:
        assert tok(t)["input_ids"] == [1] + sp.encode(t), t
    ids = sp.encode("kalo mine ru ta")
    assert tok.decode(ids) == sp.decode(ids)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 0, 3)


def test_pipeline_text_generation(exported):
    from transformers import AutoTokenizer, pipeline
    import tngram.hf  # noqa: F401
    model, d = exported["mini-tngram"]
    pipe = pipeline("text-generation", model=str(d))
    out = pipe("kalo mine", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    tok = AutoTokenizer.from_pretrained(str(d))
    prompt = torch.tensor([tok("kalo mine")["input_ids"]])
    ref = greedy_by_recomputation(model, prompt, 8)
    assert out == tok.decode(ref[0], skip_special_tokens=True)


def test_fresh_process_after_import_tngram_hf(exported):
    """A new interpreter: `import tngram.hf` + the Auto classes, no trust_remote_code."""
    d = exported["mini-engram"][1]
    code = ("import tngram.hf, torch\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(d)!r})\n"
            f"t = AutoTokenizer.from_pretrained({str(d)!r})\n"
            "ids = t('kalo mine', return_tensors='pt')['input_ids']\n"
            "print(type(m).__name__, m.generate(ids, max_new_tokens=3, do_sample=False).shape[1] - ids.shape[1])\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] == ["TngramGPTForCausalLM", "3"]


def test_errors(exported, tmp_path, capsys):
    model, d = exported["mini-tngram"]
    assert main(["export", str(tmp_path / "nope"), "--hf", str(tmp_path / "x")]) == 2
    assert "is not a run folder" in capsys.readouterr().err
    assert main(["export", str(d), "--hf", str(d)]) == 2           # never overwrites
    assert "already exists and is not empty" in capsys.readouterr().err
    from tngram.common import TngramError
    hf = load(d)
    ids = torch.randint(3, TINY_VOCAB, (2, 5))
    with pytest.raises(TngramError, match="inputs_embeds is unsupported"):
        hf(inputs_embeds=torch.zeros(2, 5, 32))
    with torch.no_grad():   # right padding: the real positions are unchanged (causality)
        right = hf(ids, attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])).logits
    torch.testing.assert_close(right[0, :3], model(ids)[0, :3], rtol=0, atol=1e-5)
    torch.testing.assert_close(right[1], model(ids)[1], rtol=0, atol=1e-5)
    with pytest.raises(TngramError, match="must lie in"):
        hf(torch.tensor([[TINY_VOCAB]]))


def test_warm_start_from_an_export_folder(exported):
    """run.init_from accepts an export folder: the backbone loads, the new memory keeps its init."""
    from tngram.train.warmstart import apply_warmstart, is_memory_param
    raw, d = exported["mini-raw"]
    tn_cfg = exported["mini-tngram"][0].config
    model = GPT(replace(tn_cfg, memory_seed=5))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    apply_warmstart(model, str(d), "memory")
    for k, v in model.state_dict().items():
        assert torch.equal(v, raw.state_dict()[k] if not is_memory_param(k) else init[k]), k
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_memory_param(n) for n in trainable)


def test_export_of_a_pruned_adaptive_rank_run(tiny_data, tmp_path):
    """A run whose TN-gram modules were pruned to different CP ranks (adaptive rank) exports and
    reloads with those ranks: same shapes, same logits as our pruned model."""
    from tngram.memory.cp_rank import cp_ranks, prune_tngram, tngram_modules

    run, model = tiny_run(tmp_path / "runs", "mini-tngram", tiny_data)
    (_, m0), (_, m1) = tngram_modules(model)
    prune_tngram(m0, torch.tensor([0, 2, 3, 5, 7]))           # 8 -> 5 components
    prune_tngram(m1, torch.tensor([1, 4, 6]))                 # 8 -> 3
    assert cp_ranks(model) == [5, 3]
    save_final_weights(run, model, 2)                          # the run's final weights are pruned
    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    hf = load(out)
    assert cp_ranks(hf.model) == [5, 3]
    ids = torch.randint(3, TINY_VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model(ids), atol=1e-6, rtol=0)


# ---- padding, hidden states, attentions, tied head (what pipelines and lm-eval use) ---------

def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.zeros(n - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(n - len(r)), torch.ones(len(r))]) for r in rows]).long()
    return ids, mask


@pytest.mark.parametrize("recipe", RECIPES)
def test_left_padded_rows_compute_what_they_compute_alone(exported, recipe):
    model, d = exported[recipe]
    hf = load(d)
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(3, TINY_VOCAB, (n,), generator=g) for n in (9, 4, 6)]
    ids, mask = left_padded(rows)
    with torch.no_grad():
        logits = hf(ids, attention_mask=mask).logits
        for b, r in enumerate(rows):
            torch.testing.assert_close(logits[b, -len(r):], model(r[None])[0], rtol=0, atol=2e-5)
    # greedy generate on the padded batch = each row alone (our GPT, full recomputation)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    for b, r in enumerate(rows):
        assert torch.equal(out[b, ids.shape[1]:], greedy_by_recomputation(model, r[None], 8)[0, len(r):])
    beams = [hf.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False,
                         eos_token_id=None, pad_token_id=0, use_cache=c) for c in (True, False)]
    assert torch.equal(beams[0], beams[1])


@pytest.mark.parametrize("recipe", ["mini-engram", "mini-oe"])
def test_hidden_states_and_attentions(exported, recipe):
    model, d = exported[recipe]
    hf = load(d)
    ids = torch.randint(3, TINY_VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    blocks = []   # independent: our GPT's block outputs, captured by hooks on its own forward
    hooks = [b.register_forward_hook(lambda m, a, out: blocks.append(out)) for b in model.blocks]
    with torch.no_grad():
        final = model.hidden(ids)
        out = hf(ids, output_hidden_states=True, output_attentions=True)
    for h in hooks:
        h.remove()
    n = model.config.n_layer
    assert len(out.hidden_states) == n + 1 and len(out.attentions) == n
    for got, want in zip(out.hidden_states[1:-1], blocks[:-1]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.hidden_states[-1], final, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.logits, model(ids), rtol=0, atol=1e-5)
    for a in out.attentions:   # (B, H, T, T): causal rows of a softmax
        assert a.shape == (2, model.config.n_head, 7, 7)
        torch.testing.assert_close(a.sum(-1), torch.ones(2, model.config.n_head, 7))
        assert torch.all(a.triu(1) == 0)
    assert hf(ids).hidden_states is None and hf(ids).attentions is None


def test_tied_embeddings_are_reported(exported):
    hf = load(exported["mini-raw"][1])
    assert hf.config.tie_word_embeddings is True
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    assert not any("lm_head" in k for k in hf.state_dict())


def test_pipeline_batch_with_left_padding(exported):
    from transformers import AutoTokenizer, pipeline
    model, d = exported["mini-tngram"]
    tok = AutoTokenizer.from_pretrained(str(d))
    assert tok.padding_side == "left"
    pipe = pipeline("text-generation", model=str(d))
    prompts = ["kalo mine ru ta zen", "ber"]
    batched = pipe(prompts, batch_size=2, max_new_tokens=6, do_sample=False)
    for p, got in zip(prompts, batched):
        ref = greedy_by_recomputation(model, torch.tensor([tok(p)["input_ids"]]), 6)
        assert got[0]["generated_text"] == tok.decode(ref[0], skip_special_tokens=True)


def test_exported_files_have_the_usual_mode(exported):
    """Every file of the folder gets 0666 less the umask, as the run's own files (transformers
    writes model.safetensors 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    for _, d in exported.values():
        assert {f.name: f.stat().st_mode & 0o777 for f in d.iterdir()} == {
            f.name: 0o666 & ~mask for f in d.iterdir()}
