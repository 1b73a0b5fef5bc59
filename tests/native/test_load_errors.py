"""Bad model files and bad engine inputs fail with the right exception and a clear message.

Each case writes a tiny GGUF with gguf.GGUFWriter (or damages one) into tmp_path, so the
suite needs no model download. Nothing here may crash the interpreter: every failure must
surface as ModelLoadError / InvalidRequestError / EngineError.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from worker.engine import Engine, EngineError, native
from worker.errors import InvalidRequestError, ModelLoadError, SpecdError
from worker.model_file import open_model

# A tiny llama: 2 layers, dim 64, 4 heads of 16 (2 KV heads), ffn 96, vocab 40.
TINY = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, n_vocab=40, n_ctx=64)


def tiny_tensors(arch: str = "llama") -> dict[str, np.ndarray]:
    """name -> float32 array in numpy order (n_out, n_in); GGUF's ne is the reverse."""
    rng = np.random.default_rng(0)  # values are irrelevant here: only names/shapes/types matter
    d, f, v = TINY["dim"], TINY["ffn_dim"], TINY["n_vocab"]
    hd = d // TINY["n_heads"]
    kvd = TINY["n_kv_heads"] * hd

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    t = {"token_embd.weight": w(v, d), "output_norm.weight": np.ones(d, np.float32)}
    for i in range(TINY["n_layers"]):
        p = f"blk.{i}."
        t |= {
            p + "attn_norm.weight": np.ones(d, np.float32),
            p + "attn_q.weight": w(d, d),
            p + "attn_k.weight": w(kvd, d),
            p + "attn_v.weight": w(kvd, d),
            p + "attn_output.weight": w(d, d),
            p + "ffn_norm.weight": np.ones(d, np.float32),
            p + "ffn_gate.weight": w(f, d),
            p + "ffn_up.weight": w(f, d),
            p + "ffn_down.weight": w(d, f),
        }
        if arch == "qwen2":
            t |= {p + "attn_q.bias": w(d), p + "attn_k.bias": w(kvd), p + "attn_v.bias": w(kvd)}
        if arch == "qwen3":
            t |= {p + "attn_q_norm.weight": np.ones(hd, np.float32), p + "attn_k_norm.weight": np.ones(hd, np.float32)}
    return t


def write_tiny(
    path: Path,
    *,
    arch: str = "llama",
    tensors: dict[str, np.ndarray] | None = None,
    drop_keys: tuple[str, ...] = (),
    extra_kv: dict[str, object] | None = None,
    raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
) -> Path:
    """Writes a tiny model GGUF; drop_keys omits metadata keys (without the arch prefix)."""
    w = gguf.GGUFWriter(path, arch=arch)
    kv = {
        "block_count": TINY["n_layers"],
        "embedding_length": TINY["dim"],
        "attention.head_count": TINY["n_heads"],
        "attention.head_count_kv": TINY["n_kv_heads"],
        "feed_forward_length": TINY["ffn_dim"],
        "context_length": TINY["n_ctx"],
        "vocab_size": TINY["n_vocab"],
    }
    for key, value in kv.items():
        if key not in drop_keys:
            w.add_uint32(f"{arch}.{key}", value)
    if "attention.layer_norm_rms_epsilon" not in drop_keys:
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    for name, arr in (tiny_tensors(arch) if tensors is None else tensors).items():
        w.add_tensor(name, arr)
    for name, (arr, qtype) in (raw or {}).items():
        w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_file_loads(tmp_path: Path) -> None:
    # The baseline every damaged variant below departs from must itself be fine.
    m = open_model(write_tiny(tmp_path / "tiny.gguf"))
    assert m.config.arch == "llama" and m.config.head_dim == 16 and m.config.n_vocab == 40
    assert m.config.rope_mode == "normal" and m.config.rope_dims == 16 and m.config.rope_base == 10000.0
    with Engine(m, n_ctx=32) as eng:
        assert eng.n_ctx == 32 and eng.n_vocab == 40


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such model file"):
        open_model(tmp_path / "nope.gguf")


def test_wrong_magic(tmp_path: Path) -> None:
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file.*bad magic"):
        open_model(p)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        open_model(empty)


@pytest.mark.parametrize("fraction", [0.002, 0.01, 0.05, 0.3, 0.7, 0.999])
def test_truncated_file(tmp_path: Path, fraction: float) -> None:
    # Cuts land in the header, the metadata, the tensor infos and the tensor data.
    full = write_tiny(tmp_path / "tiny.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[: max(5, int(len(full) * fraction))])
    with pytest.raises(ModelLoadError, match="truncated"):
        open_model(cut)


def test_unsupported_architecture(tmp_path: Path) -> None:
    p = write_tiny(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        open_model(p)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    # Q2_K: 256 elements in 84 bytes; two rows of 256 written as raw bytes.
    raw = {"blk.0.extra.weight": (np.zeros((2, 84), np.uint8), gguf.GGMLQuantizationType.Q2_K)}
    p = write_tiny(tmp_path / "q2k.gguf", raw=raw)
    with pytest.raises(ModelLoadError) as info:
        open_model(p)
    msg = str(info.value)
    assert "blk.0.extra.weight" in msg and "Q2_K" in msg
    assert native.supported_types() in msg and "Q4_K" in msg


def test_missing_metadata_key(tmp_path: Path) -> None:
    p = write_tiny(tmp_path / "nokey.gguf", drop_keys=("block_count",))
    with pytest.raises(ModelLoadError, match="'llama.block_count' is missing"):
        open_model(p)


def test_unsupported_rope_scaling(tmp_path: Path) -> None:
    p = write_tiny(tmp_path / "yarn.gguf", extra_kv={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ModelLoadError, match="RoPE scaling 'yarn'.*not supported"):
        open_model(p)


def test_linear_rope_scaling_and_defaults(tmp_path: Path) -> None:
    extra = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    m = open_model(write_tiny(tmp_path / "lin.gguf", drop_keys=("attention.head_count_kv",), extra_kv=extra))
    assert m.config.rope_scale == 0.25
    assert m.config.n_kv_heads == m.config.n_heads == 4  # head_count_kv defaults to head_count
    native_cfg = m.config.to_native()
    assert set(native_cfg) == {
        "arch", "n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "n_vocab",
        "n_ctx_train", "norm_eps", "rope_dims", "rope_base", "rope_scale", "rope_mode",
    }


def test_qwen_rope_mode(tmp_path: Path) -> None:
    for arch in ("qwen2", "qwen3"):
        m = open_model(write_tiny(tmp_path / f"{arch}.gguf", arch=arch))
        assert m.config.rope_mode == "neox"
        Engine(m).close()  # its extra tensors (biases / q,k norms) resolve


def test_missing_required_tensor(tmp_path: Path) -> None:
    t = tiny_tensors()
    del t["blk.1.ffn_down.weight"]
    m = open_model(write_tiny(tmp_path / "missing.gguf", tensors=t))
    with pytest.raises(ModelLoadError, match=r"no tensor 'blk\.1\.ffn_down\.weight'"):
        Engine(m)
    t = tiny_tensors("qwen3")
    del t["blk.0.attn_k_norm.weight"]
    m = open_model(write_tiny(tmp_path / "missing3.gguf", arch="qwen3", tensors=t))
    with pytest.raises(ModelLoadError, match=r"no tensor 'blk\.0\.attn_k_norm\.weight'"):
        Engine(m)


def test_wrong_tensor_shape(tmp_path: Path) -> None:
    t = tiny_tensors()
    t["blk.0.attn_k.weight"] = np.zeros((64, 64), np.float32)  # should be kv_dim=32 rows
    m = open_model(write_tiny(tmp_path / "shape.gguf", tensors=t))
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_k\.weight' has shape \[64, 64\], expected \[64, 32\]"):
        Engine(m)


def test_norm_must_be_f32(tmp_path: Path) -> None:
    t = tiny_tensors()
    t["output_norm.weight"] = t["output_norm.weight"].astype(np.float16)
    m = open_model(write_tiny(tmp_path / "f16norm.gguf", tensors=t))
    with pytest.raises(ModelLoadError, match=r"'output_norm\.weight' is stored as F16.*must be F32"):
        Engine(m)


def test_bad_config_values(tmp_path: Path) -> None:
    # 4 heads over 3 KV heads cannot be grouped.
    p = write_tiny(tmp_path / "gqa.gguf", drop_keys=("attention.head_count_kv",),
                   extra_kv={"llama.attention.head_count_kv": 3})
    with pytest.raises(ModelLoadError, match="n_heads .4. must be a multiple of n_kv_heads .3."):
        Engine(open_model(p))


def test_bad_engine_options(tmp_path: Path) -> None:
    m = open_model(write_tiny(tmp_path / "tiny.gguf"))
    with pytest.raises(InvalidRequestError, match="kv_type"):
        Engine(m, kv_type="q8_0")
    with pytest.raises(InvalidRequestError, match="max_batch"):
        Engine(m, max_batch=0)
    with pytest.raises(InvalidRequestError, match="n_ctx"):
        Engine(m, n_ctx=-5)
    with pytest.raises(InvalidRequestError, match="tensor_cores must be True, False or None"):
        Engine(m, tensor_cores="yes")
    with Engine(m, tensor_cores=True) as eng:  # a GPU reader choice: the CPU engine runs as ever
        assert eng.device == "cpu"


@pytest.mark.parametrize(
    "params, words",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"temprature": 0.7}, "unknown sampling parameter 'temprature'"),
        ({"temperature": "hot"}, "'temperature' must be a number"),
        ({"top_k": 2.5}, "'top_k' must be an integer"),
        ({"seed": -1}, r"'seed' must be in \[0, 2\*\*64\)"),
    ],
)
def test_bad_sampling_values(tmp_path: Path, params: dict, words: str) -> None:
    m = open_model(write_tiny(tmp_path / "tiny.gguf"))
    with Engine(m) as eng, eng.new_sequence() as seq:
        with pytest.raises(InvalidRequestError, match=words):
            seq.set_sampling(params)
        seq.set_sampling({"temperature": 0.7, "top_p": 0.9, "seed": 3})  # good values still pass


def test_sequence_misuse(tmp_path: Path) -> None:
    m = open_model(write_tiny(tmp_path / "tiny.gguf"))
    eng = Engine(m, n_ctx=8)
    seq = eng.new_sequence()
    with pytest.raises(EngineError, match="call prefill"):
        seq.step()
    with pytest.raises(EngineError, match="at least one token"):
        seq.prefill([])
    with pytest.raises(EngineError, match="out of range"):
        seq.prefill([0, 40])
    with pytest.raises(EngineError, match="out of range"):
        seq.prefill(np.array([2**40], dtype=np.int64))
    with pytest.raises(EngineError, match="context length exceeded: the sequence would hold 9 tokens"):
        seq.prefill(list(range(9)))
    with pytest.raises(EngineError, match="truncate"):
        seq.truncate(3)
    assert seq.n_past == 0  # failed calls leave the sequence as it was
    seq.close()
    seq.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        seq.n_past
    eng.close()
    eng.close()
    with pytest.raises(SpecdError, match="closed"):
        eng.new_sequence()
