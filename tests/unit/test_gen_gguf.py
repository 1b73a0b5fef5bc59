"""tools/gen_gguf.py: random-weight GGUFs in real shapes load, run and follow llama.cpp's layout.

Every type of the two tiny shapes (qwen3 tied with head_dim != dim / n_heads; llama untied with
rope_freqs) is opened with worker.model_file.open_model and run through the CPU engine; the
files are deterministic given the seed; the Q4_K_M mix and the vocabularies of the real shapes
are checked from the plan alone (writing a real shape takes seconds and hundreds of MB).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import gen_gguf  # noqa: E402

from worker.model_file import open_model  # noqa: E402

TINY = ("tiny", "tiny-llama")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[tuple[str, str], Path]:
    d = tmp_path_factory.mktemp("gen")
    return {(s, t): gen_gguf.write_model(d / gen_gguf.default_filename(s, t), s, t, seed=1)
            for s in TINY for t in gen_gguf.TYPES}


@pytest.mark.parametrize("shape", TINY)
@pytest.mark.parametrize("ftype", gen_gguf.TYPES)
def test_tiny_model_loads_and_gives_finite_logits(tiny_files, shape, ftype):
    from worker.engine import Engine
    from worker.tokenizer import Tokenizer

    path = tiny_files[(shape, ftype)]
    mf = open_model(path)
    s = gen_gguf.SHAPES[shape]
    c = mf.config
    assert (c.arch, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.n_vocab) == \
        (s.arch, s.dim, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim, s.ffn, s.vocab)
    assert mf.file_type == f"MOSTLY_{ftype}"
    # every tensor in the type the plan says, nothing else in the file
    plan = {t.name: t for t in gen_gguf.tensor_plan(s, ftype)}
    assert {name: gguf.GGMLQuantizationType(tid).name for name, tid, _, _ in mf.tensors} == \
        {n: t.ggml_type for n, t in plan.items()}
    assert ("output.weight" in plan) == (not s.tied)

    tok = Tokenizer.from_metadata(mf.metadata)
    text = "the quick brown fox, 42 times!"
    ids = tok.encode(text, add_special=True)
    assert tok.decode(ids, skip_special=True) == text
    assert (ids[0] == tok.bos_id) == s.add_bos
    with Engine(mf, n_ctx=256) as eng:
        seq = eng.new_sequence()
        logits = seq.prefill(ids)
        seq.set_sampling({"temperature": 0})
        steps = [seq.step()[0] for _ in range(3)]
    assert logits.shape == (s.vocab,)
    assert np.isfinite(logits).all()
    # std-0.02 weights: logits are O(0.1 .. 10), not collapsed to a constant, not exploding
    assert 0.01 < float(logits.std()) < 100
    assert all(0 <= t < s.vocab for t in steps)


@pytest.mark.parametrize("ftype", gen_gguf.TYPES)
def test_weights_have_the_stated_spread_and_sane_scales(tiny_files, ftype):
    reader = gguf.GGUFReader(tiny_files[("tiny", ftype)])
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        assert np.isfinite(values).all(), t.name
        if t.name.endswith("norm.weight"):
            assert abs(values.mean() - 1.0) < 0.01 and values.std() < 0.05, t.name
        else:
            # dequantized matrices ~ N(0, 0.02); quant scales vary by x0.5..1.5 per block
            assert 0.014 < values.std() < 0.026, (t.name, values.std())
            assert abs(values.mean()) < 0.003, (t.name, values.mean())
    if ftype == "Q4_K_M":
        for t in reader.tensors:
            if t.tensor_type.name in ("Q4_K", "Q6_K"):
                raw = np.asarray(t.data).reshape(-1, gguf.GGML_QUANT_SIZES[t.tensor_type][1])
                off = 0 if t.tensor_type.name == "Q4_K" else 208
                d = raw[:, off:off + 2].copy().view(np.float16).astype(np.float32)
                assert np.isfinite(d).all() and (d > 0).all(), t.name


def test_deterministic_given_the_seed(tmp_path, tiny_files):
    for ftype in ("F16", "Q4_K_M"):
        again = gen_gguf.write_model(tmp_path / f"a-{ftype}.gguf", "tiny", ftype, seed=1)
        other = gen_gguf.write_model(tmp_path / f"b-{ftype}.gguf", "tiny", ftype, seed=2)
        assert _sha(again) == _sha(tiny_files[("tiny", ftype)])
        assert _sha(other) != _sha(again)
        assert not Path(str(again) + ".part").exists()


def test_pool_smaller_than_a_tensor_wraps(tmp_path):
    """A pool of 50 KB is smaller than token_embd (1024 x 256 fp16 = 512 KB): the tensor is
    stitched from wrapped slices; the file must still be valid and differ from a big-pool one."""
    small = gen_gguf.write_model(tmp_path / "small.gguf", "tiny", "BF16", pool_mib=0.05)
    big = gen_gguf.write_model(tmp_path / "big.gguf", "tiny", "BF16")
    assert small.stat().st_size == big.stat().st_size and _sha(small) != _sha(big)
    mf = open_model(small)
    assert len(mf.tensors) == len(gen_gguf.tensor_plan(gen_gguf.SHAPES["tiny"], "BF16"))


def test_q4_k_m_mix_matches_llama_cpp():
    """Q6_K tensors under llama.cpp's Q4_K_M rule (src/llama-quant.cpp, counted by hand):
    Qwen3-8B (36 layers, untied) 18 attn_v + 18 ffn_down + output = 37; Llama-3.2-1B (16
    layers, tied) 8 + 8 + token_embd = 17; Qwen3-0.6B (28 layers, tied) 14 + 14 + token_embd = 29."""
    for shape, q6 in (("qwen3-8b", 37), ("llama-3.2-1b", 17), ("qwen3-0.6b", 29)):
        plan = gen_gguf.tensor_plan(gen_gguf.SHAPES[shape], "Q4_K_M")
        types = [t.ggml_type for t in plan]
        assert types.count("Q6_K") == q6, shape
        assert set(types) == {"Q4_K", "Q6_K", "F32"}
    embd = {t.name: t.ggml_type for t in gen_gguf.tensor_plan(gen_gguf.SHAPES["qwen3-8b"], "Q4_K_M")}
    assert embd["token_embd.weight"] == "Q4_K" and embd["output.weight"] == "Q6_K"
    assert [gen_gguf.use_more_bits(i, 8) for i in range(8)] == [True, False, False, True, False, False, True, True]


def test_real_shapes_sizes_and_vocabularies():
    s = gen_gguf.SHAPES
    # tensor bytes vs the published GGUF files' sizes (GB), within 2 % (metadata differs)
    for shape, ftype, gb in (("qwen3-8b", "Q4_K_M", 5.03), ("qwen3-0.6b", "F16", 1.19), ("llama-3.2-1b", "Q4_K_M", 0.81)):
        total = sum(t.nbytes for t in gen_gguf.tensor_plan(s[shape], ftype)) / 1e9
        assert abs(total / gb - 1) < 0.02, (shape, ftype, total)
    tokens, types, merges = gen_gguf.vocabulary(s["qwen3-0.6b"])
    assert len(tokens) == 151936 and tokens[151643:151646] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[151643] == gguf.TokenType.CONTROL and types[151642] == gguf.TokenType.NORMAL
    known = set(tokens)
    assert all(a in known and b in known and a + b in known for a, b in (m.split(" ") for m in merges))
    tokens, _, _ = gen_gguf.vocabulary(s["llama-3.2-1b"])
    assert len(tokens) == 128256 and tokens[128000] == "<|begin_of_text|>" and tokens[128009] == "<|eot_id|>"
    f = gen_gguf.llama3_rope_factors(64, 5e5)
    assert f.shape == (32,) and f[0] == 1.0 and f[-1] == 32.0 and np.all(np.diff(f) >= 0)


def test_cli_dry_run_and_layers(tmp_path, capsys):
    assert gen_gguf.main(["--dry-run", "-o", str(tmp_path), "qwen3-8b", "F16"]) == 0
    size, name = capsys.readouterr().out.split()
    assert int(size) == sum(t.nbytes for t in gen_gguf.tensor_plan(gen_gguf.SHAPES["qwen3-8b"], "F16"))
    assert not list(tmp_path.iterdir())
    assert gen_gguf.main(["-q", "-o", str(tmp_path), "--layers", "1", "tiny", "Q8_0"]) == 0
    mf = open_model(tmp_path / gen_gguf.default_filename("tiny", "Q8_0", 1))
    assert mf.config.n_layers == 1
    assert gen_gguf.main(["-o", str(tmp_path), "tiny", "Q5_K"]) == 2
    with pytest.raises(ValueError, match="--layers"):
        gen_gguf.resolve_shape("tiny", 3)
