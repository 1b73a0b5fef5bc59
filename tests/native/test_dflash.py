"""DFlash block drafter: converter round trip, the C++ forward against the float64 numpy
reference (tests/helpers/dflash_reference.py), the draft KV cache (incremental = from
scratch, rollback, gaps), target hidden-state capture, clear errors, and lossless greedy
speculation through the engine.

Every test writes a small random DFlash checkpoint (config.json with dflash_config +
model.safetensors in BF16, as published) for a tiny random qwen3 target
(tests/helpers/tiny_gguf.py), converts it with worker/dflash_convert.py and loads it.
Native entry points: native.DFlash (one sequence's drafter, engine/dflash_drafter.cpp,
driven through the Drafter interface: commit / rollback / draft), Engine.set_dflash
(speculation mode "dflash"), ops.forward_hidden (Model::forward with hidden capture).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.helpers.dflash_reference import DFlashReference, target_hidden_states
from tests.helpers.reference import ReferenceModel
from tests.helpers.tiny_gguf import write_tiny_model
from worker import dflash_convert as dc
from worker.engine import EngineError, native
from worker.errors import ModelLoadError
from worker.model_file import open_model

T_LAYERS, DIM, VOCAB = 4, 64, 300          # the tiny qwen3 target
LAYER_IDS = [1, 3]                         # tapped target layers (fc reads 2 x 64 features)
MASK = 297
BLOCK = 8


# ---------------------------------------------------------------- checkpoint writing


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """The safetensors layout: u64 header length, JSON header, raw little-endian data."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, arr) in tensors.items():
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


def make_config(**over) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": DIM,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "attention_bias": False,
        "dflash_config": {"block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": LAYER_IDS},
    }
    dflash_over = over.pop("dflash_config", {})
    cfg.update(over)
    cfg["dflash_config"] = {**cfg["dflash_config"], **dflash_over}
    return cfg


def make_weights(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random bf16-exact float32 weights by safetensors name: matrices ~ N(0, 1/fan_in),
    norms 1 + N(0, 0.2^2), biases N(0, 0.3^2)."""
    dim, hd, ffn = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    n_feat = len(cfg["dflash_config"]["target_layer_ids"]) * dim
    shapes = {"fc.weight": (dim, n_feat), "hidden_norm.weight": (dim,), "norm.weight": (dim,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (dim,), p + "post_attention_layernorm.weight": (dim,),
            p + "self_attn.q_proj.weight": (q, dim), p + "self_attn.k_proj.weight": (kv, dim),
            p + "self_attn.v_proj.weight": (kv, dim), p + "self_attn.o_proj.weight": (dim, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (ffn, dim), p + "mlp.up_proj.weight": (ffn, dim),
            p + "mlp.down_proj.weight": (dim, ffn),
        }
        if cfg.get("attention_bias"):
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (dim,)}
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            x = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            x = 0.3 * rng.standard_normal(shape)
        else:
            x = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = _bf16_value(_bf16(x.astype(np.float32)))
    return out


def write_checkpoint(directory: Path, cfg: dict, weights: dict[str, np.ndarray], dtype: str = "BF16") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    enc = {n: ("BF16", _bf16(w)) if dtype == "BF16" else ("F32", w.astype(np.float32)) for n, w in weights.items()}
    write_safetensors(directory / "model.safetensors", enc)
    return directory


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny qwen3 target (F32 weights, untied head) and its float64 reference."""
    path = tmp_path_factory.mktemp("dflash_target") / "target.gguf"
    write_tiny_model(path, "qwen3", "F32", n_layers=T_LAYERS, dim=DIM, n_heads=4, n_kv_heads=2, ffn=96,
                     vocab=VOCAB, seed=11)
    mf = open_model(path)
    ref = ReferenceModel(str(path))
    embd = ref.w["token_embd.weight"]   # [vocab, dim] float32
    head = ref.w["output.weight"]       # [vocab, dim] float32
    return mf, ref, embd, head


def native_dflash(dfile, target_mf, n_ctx: int = 128, kv_type: str = "f32", config: dict | None = None):
    """The engine's DFlash drafter for one sequence, driven through the Drafter interface."""
    return native.DFlash(config or dfile.config.to_native(), dfile.tensors, target_mf.config.to_native(),
                         target_mf.tensors, n_ctx, kv_type)


T1 = {"temperature": 1.0, "seed": 1}  # q rows are then exactly softmax(draft logits)


def draft_logq(nd, tokens, k: int = BLOCK - 1):
    """(drafts, log q [n, n_vocab]) of a sampled draft continuing `tokens` (history + pending)."""
    toks, q = nd.draft(np.asarray(tokens, np.int32), k, T1)
    return toks, np.log(q.astype(np.float64))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


VARIANTS = {
    # published default: full attention, non-causal (the shared op with block queries as heads)
    "noncausal": dict(),
    # a sliding layer: causal + window 5 (the dedicated windowed attention), other extras on
    "sliding": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=5, attention_bias=True,
                    dflash_config={"input_embedding_scale": 0.5, "output_multiplier": 1.7,
                                   "final_logit_softcapping": 6.0}),
    # is_causal forced for every layer (the shared causal attention), head_dim != dim / heads
    "causal": dict(is_causal=True, head_dim=24),
    # non-causal sliding window (window on both sides)
    "window2": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4, is_causal=False),
}


def build(tmp_path: Path, variant: str, seed: int, outtype: str = "f32"):
    cfg = make_config(**json.loads(json.dumps(VARIANTS[variant])))
    weights = make_weights(cfg, np.random.default_rng(seed))
    ckpt = write_checkpoint(tmp_path / f"ckpt-{variant}", cfg, weights)
    out = dc.convert(ckpt, tmp_path / f"{variant}-{outtype}.gguf", outtype, progress=False)
    return cfg, weights, dc.open_dflash(out)


# ---------------------------------------------------------------- converter


def test_convert_round_trip(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    cfg = make_config(**json.loads(json.dumps(VARIANTS["sliding"])))
    weights = make_weights(cfg, np.random.default_rng(seed))
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg, weights)

    # auto keeps BF16 matrices bit-exact; f32 widens exactly; norms are F32 either way
    for outtype, mat_type in (("auto", gguf.GGMLQuantizationType.BF16), ("f32", gguf.GGMLQuantizationType.F32)):
        path = dc.convert(ckpt, tmp_path / f"d-{outtype}.gguf", outtype, progress=False)
        reader = gguf.GGUFReader(path)
        by_name = {t.name: t for t in reader.tensors}
        assert len(by_name) == len(weights)
        for st_name, src in weights.items():
            t = by_name[dc.gguf_name(st_name)]
            want_type = gguf.GGMLQuantizationType.F32 if src.ndim == 1 else mat_type
            assert t.tensor_type == want_type, st_name
            got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(src.shape)
            np.testing.assert_array_equal(got, src, err_msg=st_name)
        # names, as docs/dflash-gguf.md lists them
        assert "dflash_fc.weight" in by_name and "dflash_hidden_norm.weight" in by_name
        assert "blk.1.attn_q_norm.weight" in by_name and "blk.0.attn_output.bias" in by_name

    # metadata equals config.json
    dfile = dc.open_dflash(tmp_path / "d-auto.gguf")
    c, md = dfile.config, dfile.metadata
    assert md["general.architecture"] == "dflash"
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.n_vocab) == (
        2, DIM, 4, 2, 16, 96, VOCAB)
    assert (c.block_size, c.mask_token_id, list(c.target_layer_ids), c.target_dim) == (BLOCK, MASK, LAYER_IDS, DIM)
    assert md["dflash.target_layer_ids"] == LAYER_IDS
    assert c.norm_eps == pytest.approx(1e-6) and c.rope_base == 10000.0 and c.rope_dims == 16
    assert (c.input_embedding_scale, c.output_multiplier, c.logit_softcap) == (0.5, pytest.approx(1.7), 6.0)
    assert c.layer_causal == (False, True) and c.layer_window == (0, 5)
    assert md["dflash.attention.layer_types"] == ["full_attention", "sliding_attention"]
    assert md["dflash.attention.sliding_window"] == 5 and md["dflash.vocab_size"] == VOCAB
    assert c.n_ctx_train == 4096

    # f16 and q8_0: the requested types, values within their rounding
    for outtype, qt in (("f16", gguf.GGMLQuantizationType.F16), ("q8_0", gguf.GGMLQuantizationType.Q8_0)):
        path = dc.convert(ckpt, tmp_path / f"d-{outtype}.gguf", outtype, progress=False)
        for t in gguf.GGUFReader(path).tensors:
            src = weights[next(n for n in weights if dc.gguf_name(n) == t.name)]
            got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(src.shape)
            if src.ndim == 1:
                np.testing.assert_array_equal(got, src)
                continue
            assert t.tensor_type == qt
            if qt == gguf.GGMLQuantizationType.F16:  # exactly numpy's rounding to half
                np.testing.assert_array_equal(got, src.astype(np.float16).astype(np.float32))
            else:
                # Q8_0: x ~ q * d, d = fp16(max|x| / 127) per 32-block: |err| <= d/2 plus
                # 127 * (fp16 rounding of d, <= 2^-11 d) = 0.5625 d; bound 0.6 d
                step = np.abs(src.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
                err = np.abs(got - src).reshape(-1, 32)
                assert np.all(err <= 0.6 * step)
                assert err.max() > 0.1 * step.max()  # really quantized


def test_convert_errors(tmp_path):
    rng = np.random.default_rng(0)
    cfg = make_config()
    weights = make_weights(cfg, rng)

    def convert(c, w=weights, name="x"):
        return dc.convert(write_checkpoint(tmp_path / name, c, w), tmp_path / f"{name}.gguf", progress=False)

    no_dflash = {k: v for k, v in cfg.items() if k != "dflash_config"}
    with pytest.raises(ModelLoadError, match="dflash_config"):
        convert(no_dflash, name="nodf")
    with pytest.raises(ModelLoadError, match="block_size"):
        convert(make_config(dflash_config={"block_size": 1}), name="b1")
    with pytest.raises(ModelLoadError, match="mask_token_id"):
        convert(make_config(dflash_config={"mask_token_id": VOCAB}), name="mask")
    with pytest.raises(ModelLoadError, match="mask_token_id"):
        c = make_config()
        del c["dflash_config"]["mask_token_id"]
        convert(c, name="nomask")
    partial = {k: v for k, v in weights.items() if k != "layers.1.mlp.up_proj.weight"}
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensor.*layers\.1\.mlp\.up_proj|blk\.1\.ffn_up"):
        convert(cfg, partial, name="partial")
    with pytest.raises(ModelLoadError, match="DFlash2"):
        convert(make_config(dflash_config={"conv_kernel_size": 4}), name="v2")
    bad_shape = dict(weights)
    bad_shape["fc.weight"] = np.zeros((DIM, 3 * DIM), np.float32)
    with pytest.raises(ModelLoadError, match="fc.weight"):
        convert(cfg, bad_shape, name="shape")
    with pytest.raises(ModelLoadError, match="outtype"):
        dc.convert(tmp_path / "x", tmp_path / "y.gguf", "q4_0", progress=False)


# ---------------------------------------------------------------- the forward


# Tolerances. The drafter is compared through log q = log softmax(draft logits) (its
# proposal distribution at temperature 1). The engine computes in float32 (matmul
# accumulation over <= 128 terms, float32 norms, attention accumulated in float32 (AVX2)
# or float64 (windowed), float32 softmax); the reference in float64 from the same
# bf16-exact weights and float32 features. Per-op relative error is ~1e-7..1e-6; observed
# over many seeds: max |error| ~1e-6 on the normalised hidden states, ~6e-6 on logits
# (|logits| <= ~15), ~3e-6 on log q (|log q| <= ~30). ATOL 5e-5 plus RTOL 1e-5 (<= 3.5e-4
# on the smallest log-probabilities) leaves >= 10x margin and still catches any wrong
# mask, position, norm or scale: flipping one layer's causal flag moves logits by > 1.
ATOL, RTOL = 5e-5, 1e-5


def _features(ref, tokens, kv_round=None):
    feats, _ = target_hidden_states(ref, tokens, LAYER_IDS, kv_round)
    return feats  # [n, 2, dim] float64


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_reference(tmp_path, target, variant):
    """The drafter, fed target features commit by commit, drafts from the logits of the
    float64 reference: first from a prompt, then after a rejected future was rolled back
    and accepted positions were committed. Its incremental draft cache must be
    bit-identical to a fresh one fed everything at once."""
    mf, ref, embd, head = target
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    cfg, weights, dfile = build(tmp_path, variant, seed)
    dref = DFlashReference(cfg, weights)

    P, m = 13, 3  # prompt positions, then pending + 2 accepted drafts committed
    tokens = rng.integers(3, VOCAB, size=P + m + 1).astype(np.int32)
    feats = _features(ref, tokens[: P + m]).astype(np.float32)  # causal: a prefix's rows don't change
    nd = native_dflash(dfile, mf)
    assert nd.hidden_layers == LAYER_IDS
    assert nd.draft(tokens[: P + 1], BLOCK - 1) == ([], None)  # no context yet: no proposal

    # step 1: context = positions 0..P-1, block from tokens[P] at positions P..P+B-1
    nd.commit(P, feats[:P])
    toks, logq = draft_logq(nd, tokens[: P + 1])
    want = log_softmax(dref.draft_logits(feats[:P], embd, head, int(tokens[P])))
    assert len(toks) == BLOCK - 1 and logq.shape == (BLOCK - 1, VOCAB)
    np.testing.assert_allclose(logq, want, atol=ATOL, rtol=RTOL)
    greedy, q = nd.draft(tokens[: P + 1], BLOCK - 1)
    assert q is None
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3  # rows whose argmax float error cannot flip
    assert clear.any()  # (a soft-cap can squeeze the top logits of a row together)
    np.testing.assert_array_equal(np.asarray(greedy)[clear], want.argmax(axis=1)[clear])

    # a rejected future: 2 positions committed, then rolled back
    nd.commit(P + 2, rng.standard_normal((2, len(LAYER_IDS), DIM)).astype(np.float32))
    nd.rollback(P)
    # step 2: pending + 2 accepted drafts committed; draft from tokens[P+m]
    nd.commit(P + m, feats[P : P + m])
    toks2, logq2 = draft_logq(nd, tokens[: P + m + 1])
    want2 = log_softmax(dref.draft_logits(feats[: P + m], embd, head, int(tokens[P + m])))
    np.testing.assert_allclose(logq2, want2, atol=ATOL, rtol=RTOL)
    assert np.abs(logq2 - logq).max() > 1e-2  # a different step: not vacuous

    fresh = native_dflash(dfile, mf)
    fresh.commit(P + m, feats[: P + m])
    toks3, logq3 = draft_logq(fresh, tokens[: P + m + 1])
    np.testing.assert_array_equal(logq3, logq2)
    assert toks3 == toks2
    # k below the block drafts a prefix of the same block; k above drafts B-1
    toks4, logq4 = draft_logq(fresh, tokens[: P + m + 1], k=3)
    np.testing.assert_array_equal(logq4, logq2[:3])
    assert len(draft_logq(fresh, tokens[: P + m + 1], k=BLOCK + 5)[0]) == BLOCK - 1

    # a gap (position P+m never committed) leaves the context incomplete: no proposals
    gap = native_dflash(dfile, mf)
    gap.commit(P, feats[:P])
    gap.commit(P + m, feats[P + 1 : P + m])
    assert gap.draft(tokens[: P + m + 1], 4) == ([], None)
    gap.rollback(P)
    gap.commit(P + m, feats[P : P + m])
    assert draft_logq(gap, tokens[: P + m + 1])[0] == toks2


def test_forward_f16_cache(tmp_path, target):
    """An fp16 draft cache: the reference rounds K (after RoPE) and V to fp16 likewise."""
    mf, ref, embd, head = target
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    cfg, weights, dfile = build(tmp_path, "sliding", seed, outtype="auto")  # BF16 matrices
    dref = DFlashReference(cfg, weights)
    tokens = rng.integers(3, VOCAB, size=20).astype(np.int32)
    feats = _features(ref, tokens[:19]).astype(np.float32)
    nd = native_dflash(dfile, mf, kv_type="f16")
    nd.commit(19, feats)
    _, logq = draft_logq(nd, tokens)
    want = log_softmax(dref.draft_logits(feats, embd, head, int(tokens[19]), kv_round="f16"))
    unrounded = log_softmax(dref.draft_logits(feats, embd, head, int(tokens[19])))
    # Engine and reference round K/V to fp16 after different (1e-6) float32/float64 errors,
    # so a few of the ~3500 cached elements land on the other side of an fp16 rounding
    # boundary (1 ulp = 2^-11 relative); observed max |error| up to ~1.1e-3. Bound 3e-3
    # catches a garbled fp16 path (errors O(1)); the mean then shows the engine rounds like
    # the fp16 reference rather than not at all (fp16 rounding moves logits by ~5e-3).
    np.testing.assert_allclose(logq, want, atol=3e-3, rtol=0)
    assert np.abs(logq - want).mean() < 0.5 * np.abs(logq - unrounded).mean()


def test_target_hidden_capture(target):
    """Model::forward's capture equals the reference residual stream after each tapped layer."""
    mf, ref, _, _ = target
    rng = np.random.default_rng()
    tokens = rng.integers(0, VOCAB, size=17).astype(np.int32)
    layers = [3, 0, 1, 3]  # any order, repeats allowed
    want_f, want_logits = target_hidden_states(ref, tokens, layers)
    np.testing.assert_allclose(want_logits, ref.logits(tokens, kv_round=None), rtol=1e-12, atol=1e-12)
    logits, hidden = native.ops.forward_hidden(mf.config.to_native(), mf.tensors, tokens, layers, "f32")
    assert hidden.shape == (17, 4, DIM)
    # residual stream is O(1..10); float32 over 4 layers: observed ~1e-5
    np.testing.assert_allclose(hidden, want_f, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(hidden[:, 0], hidden[:, 3])
    # capture off = the same logits, bit for bit
    logits_off, _ = native.ops.forward_hidden(mf.config.to_native(), mf.tensors, tokens, [], "f32")
    np.testing.assert_array_equal(logits, logits_off)


# ---------------------------------------------------------------- errors


def test_pairing_errors(tmp_path, target):
    mf = target[0]
    _, _, dfile = build(tmp_path, "noncausal", 1)
    dc.check_pair(dfile.config, mf.config)  # the matching target passes
    small = open_model(write_tiny_model(tmp_path / "t32.gguf", "qwen3", "F32", dim=32, vocab=VOCAB))
    with pytest.raises(ModelLoadError, match="hidden size 64.*has 32"):
        dc.check_pair(dfile.config, small.config)
    other_vocab = open_model(write_tiny_model(tmp_path / "v256.gguf", "qwen3", "F32", dim=DIM, vocab=280))
    with pytest.raises(ModelLoadError, match="vocabulary has 300 tokens, the target's 280"):
        dc.check_pair(dfile.config, other_vocab.config)
    shallow = open_model(write_tiny_model(tmp_path / "l2.gguf", "qwen3", "F32", n_layers=2, dim=DIM, vocab=VOCAB))
    with pytest.raises(ModelLoadError, match="taps target layer 3"):
        dc.check_pair(dfile.config, shallow.config)
    # the native engine refuses the same pairings
    for t in (small, other_vocab, shallow):
        eng = native.Engine(t.config.to_native(), t.tensors, {"n_ctx": 64})
        with pytest.raises(EngineError, match="DFlash drafter"):
            eng.set_dflash(dfile.config.to_native(), dfile.tensors)

    for t in (small, other_vocab, shallow):
        with pytest.raises(EngineError, match="DFlash drafter"):
            native_dflash(dfile, t)

    # block size out of range, as the native engine sees it
    for bad in (0, 1, 2000):
        with pytest.raises(EngineError, match="block_size"):
            native_dflash(dfile, mf, config={**dfile.config.to_native(), "block_size": bad})
    nd = native_dflash(dfile, mf)
    with pytest.raises(EngineError, match="captured 3 layers"):
        nd.commit(4, np.zeros((4, 3, DIM), np.float32))
    # a file that is not DFlash
    with pytest.raises(ModelLoadError, match="expected 'dflash'"):
        dc.open_dflash(mf.path)


# ---------------------------------------------------------------- speculation


def _generate(eng, prompt, n_new, spec=None, sampling=None):
    seq = eng.new_sequence()
    eng.set_sampling(seq, sampling or {"temperature": 0.0})
    if spec:
        eng.set_speculation(seq, spec)
    eng.prefill(seq, np.asarray(prompt, np.int32), False, False)
    out = []
    while len(out) < n_new:
        out += eng.step(seq)
    stats = eng.stats(seq)
    eng.free_sequence(seq)
    return out[:n_new], stats


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_greedy_speculation_is_exact(tmp_path, target, kv_type):
    """A random DFlash drafter accepts ~nothing, but greedy output must be plain greedy."""
    mf, _, _, _ = target
    _, _, dfile = build(tmp_path, "noncausal", 3)
    eng = native.Engine(mf.config.to_native(), mf.tensors, {"n_ctx": 160, "kv_type": kv_type, "max_batch": 7})
    eng.set_dflash(dfile.config.to_native(), dfile.tensors)
    rng = np.random.default_rng()
    for _ in range(2):
        prompt = rng.integers(3, VOCAB, size=int(rng.integers(5, 30))).tolist()
        plain, _ = _generate(eng, prompt, 48)
        for k in (1, 4, BLOCK - 1, 16):  # k > block_size - 1 drafts block_size - 1
            spec, stats = _generate(eng, prompt, 48, {"mode": "dflash", "k": k})
            assert spec == plain, (k, prompt)
            assert stats["drafted"] > 0 and stats["spec_steps"] > 0  # the drafter really ran
            assert 0 < len(stats["drafted_per_position"]) <= min(k, BLOCK - 1)  # at most B-1 drafts a step


def test_dflash_speculation_is_not_pausable(tmp_path, target):
    """set_speculation("none") keeps a draft-model or n-gram drafter for a switch back, not a
    DFlash drafter (it was not given the hidden states of plainly decoded positions): the
    engine says which, and the Generator governs only what it may pause."""
    mf, _, _, _ = target
    _, _, dfile = build(tmp_path, "noncausal", 3)
    eng = native.Engine(mf.config.to_native(), mf.tensors, {"n_ctx": 64})
    eng.set_dflash(dfile.config.to_native(), dfile.tensors)
    seq = eng.new_sequence()
    assert not eng.speculation_pausable(seq)  # no drafter
    eng.set_speculation(seq, {"mode": "ngram", "k": 4})
    assert eng.speculation_pausable(seq)
    eng.set_speculation(seq, {"mode": "dflash", "k": 4})
    assert not eng.speculation_pausable(seq)
    eng.set_speculation(seq, {"mode": "none", "k": 4})
    assert not eng.speculation_pausable(seq)
    with pytest.raises(EngineError):
        eng.speculation_pausable(seq + 1)  # no such sequence


def test_sampling_speculation_runs(tmp_path, target):
    """Sampling with DFlash drafts: valid tokens, drafts proposed with their q rows."""
    mf, _, _, _ = target
    _, _, dfile = build(tmp_path, "sliding", 4)
    eng = native.Engine(mf.config.to_native(), mf.tensors, {"n_ctx": 128})
    eng.set_dflash(dfile.config.to_native(), dfile.tensors)
    out, stats = _generate(eng, [5, 6, 7, 8, 9], 40, {"mode": "dflash", "k": BLOCK - 1},
                           {"temperature": 0.8, "top_p": 0.95, "repetition_penalty": 1.1, "seed": 7})
    assert len(out) == 40 and all(0 <= t < VOCAB for t in out)
    assert stats["drafted"] > 0


def test_engine_drafts_match_standalone(tmp_path):
    """The engine's DFlash drafter (target hidden states captured by the engine, context
    appended commit by commit) drafts what a standalone drafter drafts from features of
    one whole-sequence target forward. Made observable through acceptance: the target's
    head is reduced to two tokens (+u, -u), so target and drafter each pick 5 or 6 by a
    context-dependent sign and a fair share of drafts is accepted; the per-position
    acceptance counts of a replay must then match the engine's exactly. (A smoke test of
    the engine's hand-over: drafts depend only weakly on any single context row, which
    test_forward_matches_reference checks exactly.)"""
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    mixed = False
    for attempt in range(4):  # a draw where target or drafter is stuck on one token proves little
        accepted_at, produced = _replay_against_engine(tmp_path / str(attempt), seed + attempt)
        mixed = 0 < sum(accepted_at) < produced - 1
        if mixed:
            break
    assert mixed, "no draw gave both accepted and rejected drafts"


def _replay_against_engine(tmp_path: Path, seed: int) -> tuple[list[int], int]:
    rng = np.random.default_rng(seed)
    tmp_path.mkdir()
    path = write_tiny_model(tmp_path / "two.gguf", "qwen3", "F32", n_layers=T_LAYERS, dim=DIM, n_heads=4,
                            n_kv_heads=2, ffn=96, vocab=VOCAB, seed=seed % 1000)
    reader = gguf.GGUFReader(path, "r+")
    head = next(t for t in reader.tensors if t.name == "output.weight").data  # [vocab, dim] memmap
    u = rng.standard_normal(DIM).astype(np.float32)
    head[...] = 0.0
    head[5], head[6] = u, -u
    head.flush()
    del reader, head
    mf = open_model(path)
    _, _, dfile = build(tmp_path, "noncausal", seed)

    eng = native.Engine(mf.config.to_native(), mf.tensors, {"n_ctx": 256, "kv_type": "f32", "max_batch": 5})
    eng.set_dflash(dfile.config.to_native(), dfile.tensors)
    prompt = rng.integers(3, VOCAB, size=11).tolist()
    n_new, k = 60, BLOCK - 1
    plain, _ = _generate(eng, prompt, n_new + BLOCK)
    spec, stats = _generate(eng, prompt, n_new, {"mode": "dflash", "k": k})
    assert spec == plain[:n_new]

    # replay: step 1 samples g0 without a forward; then each step drafts from pending g[j]
    seq = np.asarray(prompt + plain, np.int32)
    _, feats = native.ops.forward_hidden(mf.config.to_native(), mf.tensors, seq, LAYER_IDS, "f32")
    accepted_at = [0] * k
    j, produced = 0, 1
    while produced < n_new:
        n_past = len(prompt) + j
        nd = native_dflash(dfile, mf, n_ctx=256)
        nd.commit(n_past, np.ascontiguousarray(feats[:n_past]))
        drafts, _ = nd.draft(seq[: n_past + 1], k)
        m = 0
        while m < k and drafts[m] == plain[j + 1 + m]:
            m += 1
        for i in range(m):
            accepted_at[i] += 1
        j += m + 1
        produced += m + 1
    assert stats["accepted_per_position"] == accepted_at[: len(stats["accepted_per_position"])]
    assert stats["accepted"] == sum(accepted_at)
    return accepted_at, produced
