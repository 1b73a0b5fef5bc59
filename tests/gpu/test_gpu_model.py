"""Whole-model GPU checks on tiny random GGUFs: logits CUDA/HIP vs the CPU engine for every
architecture and weight type, batch invariance on the device, greedy decoding with the
argmax on the device, lossless speculation (draft model, n-gram), and device errors.

Tolerances (max |gpu - cpu| / max |cpu logit|):
- SMALL_TOL = 1e-4 for forwards of <= 64 positions (decode, verify, short prompts): both
  backends compute in float32 on the same dequantized weights with an f32 KV cache, so they
  differ only by summation order (~1e-6 through 2 layers, see tests/native/test_model_logits).
- SMALL_F16_TOL = 2e-3 with the default fp16 KV cache: the two round slightly different
  float32 K/V values to fp16, so an element near a rounding boundary can land one fp16 ulp
  apart, which random weights amplify (the CPU tests measure <= 2.4e-4 for the same effect).
- LARGE_TOL = 3e-2 for prefill chunks of > 64 positions, which run on tensor cores with the
  activations rounded to fp16 (11 significant bits, ~2.4e-4 relative per element) and the
  quantized weights decoded to fp16: random weights amplify this through 2 layers ~10x.
- top-1 equal wherever the CPU's top-2 gap exceeds twice the measured error.
"""

from __future__ import annotations

import os
import secrets
import zlib

import numpy as np
import pytest

from helpers.tiny_gguf import K_QUANTS, WEIGHT_TYPES, write_tiny_model

SMALL_TOL = 1e-4
SMALL_F16_TOL = 2e-3
LARGE_TOL = 3e-2
SEED = int(os.environ.get("SPECD_TEST_SEED", secrets.randbits(31)))
DEVICE = os.environ.get("SPECD_TEST_DEVICE", "cuda:0")

ARCHS = {
    "llama": dict(arch="llama"),
    "llama_tied": dict(arch="llama", tied=True),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "llama_rope_freqs": dict(arch="llama", rope_freqs=True, rope_linear_factor=2.0),
}


def _device() -> str:
    from worker.engine import native

    return DEVICE if DEVICE.split(":")[0] == native.backend else f"{native.backend}:0"


def _model(tmp_path, name: str, weight_type: str, **kw) -> str:
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    arch = kw.get("arch", "llama")
    if weight_type in K_QUANTS:
        shape = dict(dim=256, ffn=512, n_heads=4, n_kv_heads=2, head_dim=128 if arch == "qwen3" else None)
    else:
        shape = dict(dim=64, ffn=96, n_heads=4, n_kv_heads=2, head_dim=32 if arch == "qwen3" else None)
    return write_tiny_model(tmp_path / f"{name}.gguf", weight_type=weight_type, seed=int(rng.integers(1 << 31)),
                            ctx=512, **{**shape, **kw, "arch": arch})


def _logits(path: str, device: str, tokens: np.ndarray, kv_type: str = "f32", chunks=None,
            tensor_cores: bool = False) -> np.ndarray:
    from worker.engine import Engine
    from worker.model_file import open_model

    with Engine(open_model(path), kv_type=kv_type, device=device, n_ctx=512, n_threads=2,
                tensor_cores=tensor_cores) as eng:
        seq = eng.new_sequence()
        parts = np.split(tokens, np.cumsum(chunks)[:-1]) if chunks else [tokens]
        out = np.concatenate([np.asarray(seq.prefill(p, all_logits=True)) for p in parts], axis=0)
    assert out.shape == (len(tokens), 300) and np.isfinite(out).all()
    return out.astype(np.float64)


def assert_close(got: np.ndarray, ref: np.ndarray, tol: float, what: str) -> float:
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert err <= tol, f"{what}: max rel logit error {err:.3g} > {tol:g} (SPECD_TEST_SEED={SEED})"
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 2 * np.abs(got - ref).max()
    assert decisive.mean() >= 0.7, f"{what}: top-1 blurred at {np.count_nonzero(~decisive)} positions"
    same = got.argmax(-1) == ref.argmax(-1)
    assert same[decisive].all(), f"{what}: top-1 differs at {np.flatnonzero(decisive & ~same).tolist()}"
    return err


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_cpu(tmp_path, arch, weight_type):
    path = _model(tmp_path, f"{arch}_{weight_type}", weight_type, **ARCHS[arch])
    rng = np.random.default_rng([SEED, 1])
    short = rng.integers(0, 300, size=24).astype(np.int32)
    e32 = assert_close(_logits(path, _device(), short, "f32"), _logits(path, "cpu", short, "f32"), SMALL_TOL,
                       f"{arch} {weight_type} kv f32")
    e16 = assert_close(_logits(path, _device(), short, "f16"), _logits(path, "cpu", short, "f16"), SMALL_F16_TOL,
                       f"{arch} {weight_type} kv f16")
    # the same on tensor cores (F16 weights; the other types keep the CUDA-core reader)
    etc = assert_close(_logits(path, _device(), short, "f32", tensor_cores=True), _logits(path, "cpu", short, "f32"),
                       SMALL_TOL, f"{arch} {weight_type} kv f32 tensor cores")
    # > 64 positions in one forward: the tensor-core prefill path, then small chunks on top
    long = rng.integers(0, 300, size=200).astype(np.int32)
    el = assert_close(_logits(path, _device(), long, "f32", chunks=[150, 50]),
                      _logits(path, "cpu", long, "f32", chunks=[150, 50]), LARGE_TOL, f"{arch} {weight_type} prefill")
    print(f"{arch} {weight_type}: small f32 {e32:.2e} (tensor cores {etc:.2e}), small f16 {e16:.2e}, "
          f"prefill {el:.2e}")


@pytest.mark.parametrize("start", [40, 240], ids=["first-chunk", "across-256"])
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
@pytest.mark.parametrize("weight_type", ["F16", "Q8_0", "Q4_K"])
def test_forward_is_batch_invariant_on_device(tmp_path, weight_type, tensor_cores, start):
    """A position's logits are bit-identical whether computed alone (decode) or with up to
    64 others (speculative verify): what makes speculation on the GPU lossless. Decode steps
    from position 256 (kAttnApartFrom) combine the attention chunks in a launch of their own
    (another graph), those before it in the decode kernel, and a verify folds them: from 240
    the 33 positions cross 256, where the combine moves and a chunk boundary for every chunk
    size (kAttnChunk, 64 to 256); from 40 they stay in the first chunk where it is 256."""
    from worker.engine import Engine
    from worker.model_file import open_model

    path = _model(tmp_path, f"inv_{weight_type}", weight_type, arch="qwen3")
    rng = np.random.default_rng([SEED, 2])
    prompt = rng.integers(0, 300, size=start).astype(np.int32)
    more = rng.integers(0, 300, size=33).astype(np.int32)
    with Engine(open_model(path), device=_device(), n_ctx=512, tensor_cores=tensor_cores) as eng:
        a, b = eng.new_sequence(), eng.new_sequence()
        a.prefill(prompt)
        b.prefill(prompt)
        one_by_one = np.stack([np.asarray(a.prefill(more[i:i + 1], all_logits=True))[0] for i in range(len(more))])
        batched = np.asarray(b.prefill(more, all_logits=True))
    assert np.array_equal(one_by_one, batched)


def _greedy(eng, prompt, n: int, mode: str = "none", k: int = 4) -> list[int]:
    seq = eng.new_sequence()
    seq.set_sampling({"temperature": 0})
    if mode != "none":
        seq.set_speculation(mode, k)
    seq.prefill(prompt)
    out: list[int] = []
    while len(out) < n:
        out.extend(seq.step())
    stats = seq.stats()
    seq.close()
    return out[:n], stats


def test_device_greedy_equals_logits_argmax(tmp_path):
    """Greedy steps (argmax on the device, only ids come back) pick the argmax of the
    logits the same device computes for those positions."""
    from worker.engine import Engine
    from worker.model_file import open_model

    path = _model(tmp_path, "greedy", "Q8_0", arch="llama")
    prompt = np.random.default_rng([SEED, 3]).integers(0, 300, size=12).astype(np.int32)
    with Engine(open_model(path), device=_device(), n_ctx=512) as eng:
        toks, _ = _greedy(eng, prompt, 48)
        seq = eng.new_sequence()
        rows = np.asarray(seq.prefill(np.concatenate([prompt, toks[:-1]]).astype(np.int32), all_logits=True))
    assert rows[len(prompt) - 1:].argmax(-1).tolist() == toks


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
@pytest.mark.parametrize("mode", ["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_speculative_greedy_identical_to_plain(tmp_path, mode, k, tensor_cores):
    from worker.engine import Engine
    from worker.model_file import open_model

    target = _model(tmp_path, "target", "F16", arch="qwen3", n_layers=3)
    # the draft: the same weights (same seed) stored as Q4_0, so it agrees often but not always
    draft = write_tiny_model(tmp_path / "draft.gguf", arch="qwen3", weight_type="Q4_0", n_layers=3, dim=64,
                             ffn=96, n_heads=4, n_kv_heads=2, head_dim=32, ctx=512,
                             seed=int(np.random.default_rng([SEED, zlib.crc32(b"target")]).integers(1 << 31)))
    rng = np.random.default_rng([SEED, 4])
    base = rng.integers(3, 300, size=10).astype(np.int32)
    prompt = np.concatenate([base, base, base])  # repetitive: n-gram lookup finds continuations
    with Engine(open_model(target), device=_device(), n_ctx=512, tensor_cores=tensor_cores,
                draft_model=open_model(draft) if mode == "draft" else None) as eng:
        plain, _ = _greedy(eng, prompt, 80)
        spec, stats = _greedy(eng, prompt, 80, mode, k)
    assert spec == plain
    assert stats["drafted"] > 0 and stats["spec_steps"] > 0


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
@pytest.mark.parametrize("weight_type", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("k", [4, 8, 16])
def test_speculative_greedy_identical_to_plain_quantized(tmp_path, weight_type, k, tensor_cores):
    # Quantized targets whose products take the digit reader in every engine: plain steps on the
    # direct reader (1 row of x), verifies of k + 1 >= 5 rows on its tensor-core twin
    # (matvec_kq_mma.cu, NVIDIA sm_80+): the same bits, so the same greedy tokens.
    from worker.engine import Engine
    from worker.model_file import open_model

    shape = dict(dim=256, ffn=512, head_dim=128) if weight_type == "Q8_0" else {}
    target = _model(tmp_path, f"qtarget_{weight_type}", weight_type, arch="qwen3", n_layers=3, **shape)
    rng = np.random.default_rng([SEED, 5])
    base = rng.integers(3, 300, size=10).astype(np.int32)
    prompt = np.concatenate([base, base, base])  # repetitive: n-gram lookup finds continuations
    with Engine(open_model(target), device=_device(), n_ctx=512, tensor_cores=tensor_cores) as eng:
        plain, _ = _greedy(eng, prompt, 80)
        spec, stats = _greedy(eng, prompt, 80, "ngram", k)
    assert spec == plain
    assert stats["drafted"] > 0 and stats["spec_steps"] > 0


@pytest.mark.parametrize("weight_type", ["Q4_K", "Q8_0"])
def test_speculative_greedy_identical_to_plain_across_attention_chunks(tmp_path, weight_type):
    # Decoding from position 250 on crosses the attention's first chunk boundary (256): decode
    # steps combine several chunks' partials in the decode kernel's fold (rope fused in), the
    # verifies of 5 rows in the general kernel's; greedy tokens must not differ.
    from worker.engine import Engine
    from worker.model_file import open_model

    shape = dict(dim=256, ffn=512, head_dim=128) if weight_type == "Q8_0" else {}
    target = _model(tmp_path, f"ltarget_{weight_type}", weight_type, arch="qwen3", n_layers=3, **shape)
    rng = np.random.default_rng([SEED, 6])
    prompt = np.tile(rng.integers(3, 300, size=10).astype(np.int32), 25)  # 250 tokens
    with Engine(open_model(target), device=_device(), n_ctx=1024) as eng:
        plain, _ = _greedy(eng, prompt, 60)
        spec, stats = _greedy(eng, prompt, 60, "ngram", 4)
    assert spec == plain
    assert stats["drafted"] > 0 and stats["spec_steps"] > 0


def test_missing_device_is_a_clear_error(tmp_path):
    from worker.engine import Engine
    from worker.errors import ModelLoadError
    from worker.model_file import open_model

    path = _model(tmp_path, "missing", "F16")
    backend = _device().split(":")[0]
    with pytest.raises(ModelLoadError, match=rf"{backend}:97 does not exist: this machine has \d+ {backend} device"):
        Engine(open_model(path), device=f"{backend}:97")


def test_memory_report(tmp_path):
    from worker.engine import Engine
    from worker.model_file import open_model

    path = _model(tmp_path, "mem", "Q8_0")
    with Engine(open_model(path), device=_device(), n_ctx=256) as eng:
        seq = eng.new_sequence()
        seq.prefill([1, 2, 3])
        m = eng.memory()
        assert eng.device == _device()
        assert 0 < m["weights_bytes"] < 10 << 20 and m["kv_bytes"] >= 2 * 2 * 256 * 32 * 2
        assert m["device_total_bytes"] > m["device_free_bytes"] > 0 and m["device_name"]
        t = eng.bench_forward(1, 16, 3)
        assert len(t) == 3 and all(x > 0 for x in t)


def test_sampling_after_device_greedy_reads_the_kept_logits(tmp_path):
    """After greedy steps (logits kept on the device), truncate(n_past) + sampling draws from
    the kept logits (copied back): the same token as a sequence that prefilled those tokens."""
    from worker.engine import Engine
    from worker.model_file import open_model

    path = _model(tmp_path, "kept", "Q8_0", arch="qwen3")
    prompt = [int(t) for t in np.random.default_rng([SEED, 5]).integers(0, 300, size=9)]
    with Engine(open_model(path), device=_device(), n_ctx=256) as eng:
        seq = eng.new_sequence()
        seq.set_sampling({"temperature": 0})
        seq.prefill(prompt)
        out = [t for _ in range(5) for t in seq.step()]
        seq.truncate(len(prompt) + 4)
        seq.set_sampling({"temperature": 1.0, "seed": 3})
        got = seq.step()
        ref = eng.new_sequence()
        ref.prefill(prompt + out[:4])
        ref.set_sampling({"temperature": 1.0, "seed": 3})
        assert got == ref.step()


@pytest.mark.parametrize("weight_type", ["Q8_0", "F16"])
def test_run_ahead_changes_nothing_a_caller_sees(tmp_path, weight_type):
    """A GPU engine queues each greedy step's forward as step() returns the token, and the one
    after it fed its argmax on the device (run-ahead, 2 by default): two sequences stepping in
    turn (each settles the other's: the next forward then takes the settled token from the
    host), prefill after greedy steps, truncate(n_past) then sampling from the kept logits
    (the queued forwards wrote other logits buffers), closing a sequence with forwards queued,
    and the end of the context give the same tokens, logits and errors as an engine without
    it, and as one with a single forward ahead."""
    from worker.engine import Engine, EngineError
    from worker.model_file import open_model

    path = _model(tmp_path, f"ahead_{weight_type}", weight_type, arch="qwen3")
    rng = np.random.default_rng([SEED, 6])
    prompt = [int(t) for t in rng.integers(0, 300, size=21)]

    def script(eng) -> list:
        out: list = []
        a, b = eng.new_sequence(), eng.new_sequence()
        a.prefill(prompt)
        b.prefill(prompt[:5])
        for s in (a, b):
            s.set_sampling({"temperature": 0})
        for _ in range(6):
            out.append(("a", a.step(), a.n_past))
            out.append(("b", b.step(), b.n_past))
        out.append(("a+", np.asarray(a.prefill(prompt[:3])).tobytes(), a.n_past))
        out.append(("a", [t for _ in range(4) for t in a.step()], a.n_past))
        a.truncate(a.n_past)
        a.set_sampling({"temperature": 2.0, "seed": 7})
        out.append(("a~", a.step() + a.step(), a.n_past))
        b.close()
        c = eng.new_sequence()
        c.prefill((prompt * 4)[: eng.n_ctx - 3])
        c.set_sampling({"temperature": 0})
        out.append(("c", [t for _ in range(4) for t in c.step()], c.n_past))
        with pytest.raises(EngineError, match="context length exceeded"):
            c.step()
        a.close()
        c.close()
        return out

    with Engine(open_model(path), device=_device(), n_ctx=64, run_ahead=False) as eng:
        plain = script(eng)
    with Engine(open_model(path), device=_device(), n_ctx=64, run_ahead=1) as eng:
        ahead1 = script(eng)
    with Engine(open_model(path), device=_device(), n_ctx=64) as eng:
        assert eng.run_ahead == 2
        ahead = script(eng)
    assert ahead1 == plain
    assert ahead == plain


def test_a_freed_sequences_cache_serves_the_next_one(tmp_path):
    """A closed sequence's cache (and the graphs captured for it) goes back to the model and
    serves the next sequence of the same size: rows left from a longer earlier sequence are
    never read (the tokens equal a fresh engine's), and the kept cache counts as scratch."""
    from worker.engine import Engine
    from worker.model_file import open_model

    path = _model(tmp_path, "pool", "Q8_0", arch="qwen3")
    rng = np.random.default_rng([SEED, 7])
    long_prompt = rng.integers(0, 300, size=50).astype(np.int32)
    short = rng.integers(0, 300, size=5).astype(np.int32)
    with Engine(open_model(path), device=_device(), n_ctx=128) as eng:
        fresh, _ = _greedy(eng, short, 30)
    with Engine(open_model(path), device=_device(), n_ctx=128) as eng:
        before = eng.memory()["scratch_bytes"]
        _greedy(eng, long_prompt, 40)  # fills positions 0..89, then closes
        kept = eng.memory()["scratch_bytes"] - before
        reused, _ = _greedy(eng, short, 30)
        assert kept >= 2 * 2 * 128 * 32 * 2  # K and V of the closed sequence, fp16
    assert reused == fresh
