"""`specd models derive` (worker/cli.py -> worker/derive.py): a truncated, re-quantized copy
of the demo model opens as a valid model with the asked layer count and weight type, and a
bad --layers is the CLI's one-line error with exit status 2 (no file written)."""

from __future__ import annotations

from pathlib import Path

import gguf

from worker.cli import main
from worker.model_file import open_model


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_derive_two_layer_q8_0(capsys, tmp_path, demo_model_path):
    dst = tmp_path / "demo-2l-q8_0.gguf"
    rc, out, err = run_cli(capsys, "models", "derive", demo_model_path, dst, "--type", "Q8_0", "--layers", 2,
                           "--quiet")
    assert rc == 0, err
    assert out.strip() == str(dst) and dst.is_file()

    mf = open_model(dst)
    assert mf.config.n_layers == 2
    assert mf.config.dim == 576 and mf.config.n_vocab == 49152  # the rest of the model is unchanged
    names = {name for name, _, _, _ in mf.tensors}
    assert "blk.1.attn_q.weight" in names and not any(n.startswith("blk.2.") for n in names)
    q8 = int(gguf.GGMLQuantizationType.Q8_0)
    matrices = [(name, tid) for name, tid, ne, _ in mf.tensors if len(ne) >= 2]
    assert len(matrices) == 1 + 2 * 7  # token_embd + 7 matrices (q k v o gate up down) per block
    assert all(tid == q8 for _, tid in matrices), matrices
    # 1-D norms stay F32
    assert all(tid == int(gguf.GGMLQuantizationType.F32) for _, tid, ne, _ in mf.tensors if len(ne) == 1)


def test_derive_bad_layers_is_one_line_error(capsys, tmp_path, demo_model_path):
    for bad in (0, 31):  # the demo model has 30 blocks
        dst = tmp_path / f"bad-{bad}.gguf"
        rc, out, err = run_cli(capsys, "models", "derive", demo_model_path, dst, "--layers", bad, "--quiet")
        assert rc == 2 and out == ""
        assert err == f"error: n_layers must be in 1..30, got {bad}\n"
        assert not dst.exists()
    # an unknown source model is the same kind of error
    rc, _, err = run_cli(capsys, "models", "derive", tmp_path / "missing.gguf", tmp_path / "x.gguf")
    assert rc == 2 and err.startswith("error: model ") and err.count("\n") == 1
