"""`python -m research bench decode` on tiny shapes: the decode path is exact, the FLOP count is the derived one."""

from __future__ import annotations

from research.cli import main as research_main
import pytest
import torch

from research.bench import decode
from tngram.cli import main
from tngram.memory.gating import GatedFusion


@pytest.mark.parametrize("method", decode.METHODS)
def test_decode_ours_equals_greedy_recomputation(method):
    model = decode.build("mini", method, tiny=True)
    prompt = torch.randint(3, 1024, (1, 7), generator=torch.Generator().manual_seed(0))
    got = decode.decode_ours(model, prompt, 10)
    seq = prompt
    with torch.no_grad():                    # independent: full forward over the whole sequence
        for _ in range(10):
            seq = torch.cat([seq, model(seq)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(got, seq[:, 7:])


def test_decode_flops_match_hand_count():
    # tiny raw: L 2, D 32, 2 heads of 16, 1 KV head (kv width 16), MLP 2x, V 1024.
    # Linear weights per layer: q 32*32 + k 32*16 + v 32*16 + proj 32*32 + fc 32*64 + proj 64*32 = 7168
    # matmul FLOPs: 2 * (2 * 7168 + head 1024*32) = 94,208; attention at c = 24: 4 * 32 * 2 * 24 = 6,144
    raw = decode.build("mini", "raw", tiny=True)
    assert decode.decode_flops(raw, 24) == 94_208 + 6_144
    # tiny TN-gram (N 5, R 16, blocks 0 and 1): d_mem 4*16 = 64; K and V 2 * 64*32 weights per layer
    # -> 2 * 2 * 4096 = 16,384 FLOPs; elementwise per layer 8*32 + 5*4*16 = 576, two layers 1,152
    tn = decode.build("mini", "tngram", tiny=True)
    assert decode.decode_flops(tn, 24) == 94_208 + 6_144 + 16_384 + 1_152


def test_kv_fusion_threshold_keeps_the_numbers():
    torch.manual_seed(0)
    f = GatedFusion(48, 32, kv_bias=True, zero_init_value=False)
    for rows in (1, 63, 64, 200):
        e = torch.randn(1, rows, 48)
        k, v = f.keys_values(e)
        torch.testing.assert_close(k[:, :, 0], f.key_proj[0](e), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v[:, :, 0], f.value_proj(e), rtol=1e-6, atol=1e-6)


def test_run_reports_rows_and_ratios():
    res = decode.run(("mini",), tokens=3, prompt_len=4, reps=1, warmup=0, hf=False, tiny=True)
    assert [r["method"] for r in res["rows"]] == list(decode.METHODS)
    assert all(r["ours_ms_per_token"] > 0 for r in res["rows"])
    by = {r["method"]: r for r in res["rows"]}
    for q in res["ratios"]:
        m = q["method"]
        assert q["flop_ratio"] == pytest.approx(by[m]["flops_per_token"] / by["raw"]["flops_per_token"])
        assert q["ours_time_ratio"] == pytest.approx(by[m]["ours_ms_per_token"] / by["raw"]["ours_ms_per_token"])
    assert "ratio vs raw" in decode.report(res)


def test_bad_tokens_exit_2(capsys):
    assert research_main(["bench", "decode", "--tokens", "1", "--no-hf"]) == 2
    assert "--tokens must be >= 2" in capsys.readouterr().err
