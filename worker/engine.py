"""The Python side of the C++ <-> Python boundary: the only importer of the native module.

`Engine` wraps one resident model (weights memmapped, handed to C++ as zero-copy views),
optionally with a draft model for speculative decoding; `Sequence` is a handle on one
conversation's KV cache, sampler and drafter. Every call into C++ releases the GIL. Dev builds can point SPECD_NATIVE_DIR at a folder holding a freshly
built `_specd*.so` (see tools/dev_build.sh); installed builds ship it inside `worker/`.
"""

from __future__ import annotations

import glob
import importlib.util
import numbers
import os
import re
import sys
import weakref
from collections.abc import Mapping
from collections.abc import Sequence as _Seq
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from worker.errors import InvalidRequestError, ModelLoadError, SpecdError

if TYPE_CHECKING:
    from worker.model_file import ModelConfig, ModelFile


def _load_native() -> ModuleType:
    dev_dir = os.environ.get("SPECD_NATIVE_DIR")
    if dev_dir:
        found = sorted(glob.glob(os.path.join(dev_dir, "_specd*.so")))
        if not found:
            raise SpecdError(f"SPECD_NATIVE_DIR={dev_dir!r} holds no _specd*.so; build it with tools/dev_build.sh")
        spec = importlib.util.spec_from_file_location("worker._specd", found[0])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["worker._specd"] = module
        spec.loader.exec_module(module)
        return module
    try:
        from worker import _specd  # type: ignore[attr-defined]
    except ImportError as exc:
        raise SpecdError(
            "specd's native engine is not built in this install (built with SPECD_BACKEND=none?); "
            "reinstall with `pip install .` and the default SPECD_BACKEND=cpu"
        ) from exc
    return _specd


native = _load_native()
ops = native.ops
EngineError = native.EngineError


# ---------------------------------------------------------------- the Python API

KV_TYPES = ("f16", "f32")
_INT_SAMPLING_KEYS = ("top_k", "seed")
SPEC_MODES = ("none", "draft", "ngram")  # built in; the native engine may register more
MAX_DRAFT = int(native.max_draft)  # largest k per speculative step (engine.h kMaxDraft)


_GPU_DEVICE = re.compile(r"(cuda|hip):\d+")


def check_device(device: str) -> str:
    """`device` if this build can use it; InvalidRequestError (before anything loads) when
    the string is malformed or names a GPU backend this install was not built with. A
    missing GPU index is reported by the engine when it loads (with the devices it sees)."""
    if device == "cpu":
        return device
    m = _GPU_DEVICE.fullmatch(device) if isinstance(device, str) else None
    if not m:
        raise InvalidRequestError(f"device {device!r} is not one of cpu, cuda:N, hip:N (N = GPU index)")
    if native.backend != m.group(1):
        backend = {"cuda": "CUDA", "hip": "HIP (ROCm)"}[m.group(1)]
        raise InvalidRequestError(
            f"device {device!r}: this specd was built without the {backend} backend "
            f"(SPECD_BACKEND={native.backend}); reinstall it with SPECD_BACKEND={m.group(1)} pip install . "
            f"or use --device cpu"
        )
    return device


def check_same_vocabulary(target: ModelFile, draft: ModelFile) -> None:
    """Raises ModelLoadError unless both files carry identical token tables
    (tokenizer.ggml.tokens): speculation compares token ids, so they must mean the same."""
    key = "tokenizer.ggml.tokens"
    a, b = target.metadata.get(key), draft.metadata.get(key)
    if a is None or b is None:
        missing = target.path if a is None else draft.path
        raise ModelLoadError(f"draft model vocabulary differs from the target's: {missing} has no {key}")
    a, b = list(a), list(b)
    if a == b:
        return
    if len(a) != len(b):
        detail = f"{len(b)} tokens in {draft.path.name} vs {len(a)} in {target.path.name}"
    else:
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        detail = f"token {i} is {b[i]!r} in {draft.path.name} but {a[i]!r} in {target.path.name}"
    raise ModelLoadError(
        f"draft model vocabulary differs from the target's: {detail}; use a draft of the same "
        f"model family and tokenizer"
    )


MAX_RUN_AHEAD = int(native.max_run_ahead)  # KvStore::kMaxAhead


def _run_ahead_depth(value: bool | int) -> int:
    """run_ahead as the engine's depth: False / True are 0 / 1, else an integer 0..MAX_RUN_AHEAD."""
    if isinstance(value, bool):
        return int(value)
    if not isinstance(value, int) or not 0 <= value <= MAX_RUN_AHEAD:
        raise InvalidRequestError(f"run_ahead must be True, False, None or an integer 0..{MAX_RUN_AHEAD}, got {value!r}")
    return value


class Engine:
    """One resident model: the native engine built over `model`'s memmapped tensors.

    Options: n_ctx (tokens per sequence; None = min(n_ctx_train, 4096)), n_threads
    (None = all cores), kv_type ("f16" | "f32"), max_batch (positions per forward while
    prefilling; bounds scratch memory), draft_model (a second ModelFile with the same token
    table, for speculation mode "draft"), device ("cpu", or "cuda:N" / "hip:N" when built
    with that GPU backend; a draft model runs on the same device, always on the CUDA cores),
    tensor_cores (GPU: decode and verify forwards of the target read F16 weights on tensor
    cores, so a 16-position verify costs ~2 of those steps, but one step is ~1.9x slower than
    on the CUDA cores (H200, 2026-12-01); None = on when a draft model is given, i.e. for an
    engine that speculates), run_ahead (when step() returns a greedy
    token computed on the device, it queues that token's forward before returning, so the
    device works while the caller streams the token; the next step() only waits for it. 2
    also queues the forward after it, fed that forward's argmax on the device, so the device
    never waits for the host between steps. None = 2 for GPU devices, off on the CPU; False /
    0 off; True / 1 one forward ahead; 1 and 2 also on the CPU, where the forwards then run
    inside the returning step: for tests; the tokens are the same either way). A file whose
    tensors do not match its metadata, or a draft whose vocabulary differs, raises
    ModelLoadError; bad options raise InvalidRequestError.
    """

    def __init__(
        self,
        model: ModelFile,
        *,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        kv_type: str = "f16",
        max_batch: int = 256,
        draft_model: ModelFile | None = None,
        device: str = "cpu",
        tensor_cores: bool | None = None,
        run_ahead: bool | int | None = None,
    ) -> None:
        check_device(device)
        if tensor_cores is not None and not isinstance(tensor_cores, bool):
            raise InvalidRequestError(f"tensor_cores must be True, False or None, got {tensor_cores!r}")
        if run_ahead is not None:
            run_ahead = _run_ahead_depth(run_ahead)
        if kv_type not in KV_TYPES:
            raise InvalidRequestError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        for name, value, low in (("n_ctx", n_ctx, 1), ("n_threads", n_threads, 1), ("max_batch", max_batch, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise InvalidRequestError(f"{name} must be an integer >= {low}, got {value!r}")
        options: dict[str, Any] = {"kv_type": kv_type, "max_batch": max_batch, "device": device,
                                   "tensor_cores": draft_model is not None if tensor_cores is None else tensor_cores,
                                   "run_ahead": -1 if run_ahead is None else run_ahead}
        if n_ctx is not None:
            options["n_ctx"] = n_ctx
        if n_threads is not None:
            options["n_threads"] = n_threads
        draft_args: dict[str, Any] = {}
        dflash = draft_model is not None and draft_model.config.arch == "dflash"
        if dflash:  # a DFlash block drafter: speculation mode "dflash"
            from worker.dflash_convert import check_pair

            check_pair(draft_model.config, model.config, str(draft_model.path))
        elif draft_model is not None:
            check_same_vocabulary(model, draft_model)
            draft_args = {"draft_config": draft_model.config.to_native(), "draft_tensors": draft_model.tensors}
        try:
            self._native = native.Engine(model.config.to_native(), model.tensors, options, **draft_args)
            if dflash:
                self._native.set_dflash(draft_model.config.to_native(), draft_model.tensors)
        except EngineError as exc:  # options are checked above: what is left is the files or the device
            files = f"{model.path}" + (f" / draft {draft_model.path}" if draft_model is not None else "")
            where = "" if device == "cpu" else f" on {device}"
            raise ModelLoadError(f"{files}{where}: {exc}") from exc
        self.model = model
        self.draft_model = draft_model
        self.config: ModelConfig = model.config
        self.n_ctx: int = self._native.n_ctx
        self.n_vocab: int = self._native.n_vocab
        self.device: str = self._native.device
        self._sequences: weakref.WeakSet[Sequence] = weakref.WeakSet()

    @property
    def closed(self) -> bool:
        return self._native is None

    def _engine(self) -> Any:
        if self._native is None:
            raise EngineError("the engine is closed")
        return self._native

    def bench_forward(self, n_tokens: int, pos0: int, reps: int, all_rows: bool = True) -> list[float]:
        """Seconds of each of `reps` forwards of n_tokens positions from pos0 on a scratch
        cache (device-synchronised). all_rows: every row's argmax on the device, as a greedy
        speculative verify; else a prefill (max_batch chunks, last row's logits only)."""
        return list(self._engine().bench_forward(int(n_tokens), int(pos0), int(reps), bool(all_rows)))

    @property
    def run_ahead(self) -> int:
        """How many forwards greedy steps queue ahead before returning (0: none; the option)."""
        return int(self._engine().run_ahead)

    @run_ahead.setter
    def run_ahead(self, depth: bool | int) -> None:
        self._engine().run_ahead = _run_ahead_depth(depth)

    def memory(self) -> dict[str, Any]:
        """Bytes of weights, KV caches and scratch, and the device's total/free memory."""
        return dict(self._engine().memory())

    def new_sequence(self) -> Sequence:
        seq = Sequence(self, self._engine().new_sequence())
        self._sequences.add(seq)
        return seq

    def close(self) -> None:
        """Frees every sequence and the native engine (idempotent)."""
        if self._native is None:
            return
        for seq in list(self._sequences):
            seq.close()
        self._native = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sequence:
    """One conversation's KV cache and sampler state inside an Engine.

    Protocol: prefill(tokens) appends tokens and returns their logits; step() samples
    the next token from the current logits and leaves it pending (it enters the KV on
    the next step() or prefill()), so n_past lags the returned tokens by one.
    """

    def __init__(self, engine: Engine, seq_id: int) -> None:
        self.engine = engine
        self.id = seq_id
        self._open = True

    def _native(self) -> Any:
        if not self._open:
            raise EngineError(f"sequence {self.id} is closed")
        return self.engine._engine()

    def prefill(self, tokens: _Seq[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Appends tokens; returns float32 logits [n, n_vocab] (all_logits) or [n_vocab] (last)."""
        eng = self._native()
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise InvalidRequestError(f"tokens must be a 1-D sequence of integer ids, got {arr.dtype} {arr.shape}")
        if arr.dtype != np.int32:
            if arr.size and (arr.min() < 0 or arr.max() >= self.engine.n_vocab):
                bad = int(arr[(arr < 0) | (arr >= self.engine.n_vocab)][0])
                raise EngineError(
                    f"token id {bad} is out of range: the model's vocabulary has {self.engine.n_vocab} tokens "
                    f"(ids 0..{self.engine.n_vocab - 1})"
                )
            arr = arr.astype(np.int32)
        return eng.prefill(self.id, arr, all_logits)

    def set_sampling(self, params: Mapping[str, Any]) -> None:
        """Sets temperature, top_k, top_p, min_p, repetition/presence/frequency penalties, seed.

        Raises InvalidRequestError naming the bad key or value.
        """
        eng = self._native()
        values = dict(params)
        for key, value in values.items():
            integral = key in _INT_SAMPLING_KEYS
            if isinstance(value, bool) or not isinstance(value, numbers.Integral if integral else numbers.Real):
                kind = "an integer" if integral else "a number"
                raise InvalidRequestError(f"sampling parameter {key!r} must be {kind}, got {value!r}")
        seed = values.get("seed", 0)
        if not 0 <= seed < 2**64:
            raise InvalidRequestError(f"sampling parameter 'seed' must be in [0, 2**64), got {seed}")
        try:
            eng.set_sampling(self.id, values)
        except EngineError as exc:
            raise InvalidRequestError(f"bad sampling parameters: {exc}") from exc
        except (TypeError, RuntimeError) as exc:  # pybind11 cast errors, e.g. a negative seed
            raise InvalidRequestError(f"bad sampling parameters {values!r}: {exc}") from exc

    def set_speculation(self, mode: str = "ngram", k: int = 4, *, ngram_min: int = 1, ngram_max: int = 3) -> None:
        """Speculative decoding for this sequence from the next step on: mode "none" (off),
        "draft" (the engine's draft model), "ngram" (prompt lookup of the last ngram_max ..
        ngram_min tokens), or a drafter the native engine registered; k = tokens drafted per
        step, 1..32. Output is unchanged (greedy: identical tokens; sampling: the same
        distribution); only speed changes. Raises InvalidRequestError for bad values."""
        eng = self._native()
        for name, value in (("k", k), ("ngram_min", ngram_min), ("ngram_max", ngram_max)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise InvalidRequestError(f"speculation {name} must be an integer, got {value!r}")
        if not 1 <= k <= MAX_DRAFT:
            raise InvalidRequestError(f"speculation k must be in 1..{MAX_DRAFT} draft tokens per step, got {k}")
        if not isinstance(mode, str):
            raise InvalidRequestError(f"speculation mode must be a string, got {mode!r}")
        if mode == "draft" and not eng.has_draft_model:
            raise InvalidRequestError(
                "speculation mode 'draft' needs a draft model, and this engine has none; "
                "build it with Engine(model, draft_model=open_model(path)) or use mode 'ngram'"
            )
        try:
            eng.set_speculation(
                self.id, {"mode": mode, "k": int(k), "ngram_min": int(ngram_min), "ngram_max": int(ngram_max)}
            )
        except EngineError as exc:
            raise InvalidRequestError(f"bad speculation settings: {exc}") from exc

    def speculation_pausable(self) -> bool:
        """Whether set_speculation("none") keeps this sequence's drafter for a switch back to
        the same settings (a draft model or n-gram drafter is set; a drafter that reads the
        target's hidden states, DFlash, is not kept): the speculation a governor may pause."""
        return bool(self._native().speculation_pausable(self.id))

    def step(self) -> list[int]:
        """Samples the next token(s): 1 without speculation, 1..k+1 with it."""
        return self._native().step(self.id)

    def truncate(self, n_past: int) -> None:
        """Keeps the first n_past positions; drops later ones and any pending token."""
        self._native().truncate(self.id, n_past)

    def stats(self) -> dict[str, Any]:
        """Counters and timings: n_past, n_prompt, n_generated, n_steps, prefill_seconds,
        decode_seconds (the steps' work: time inside step(), plus the device time of forwards
        queued ahead that they used, not the waits for them); speculation: spec_steps (steps
        that forwarded with a drafter set), spec_tokens (tokens they returned), drafted,
        accepted, acceptance_length (tau = spec_tokens / spec_steps), drafted_per_position /
        accepted_per_position (lists: how many steps drafted / accepted draft i+1),
        draft_seconds, verify_seconds."""
        return self._native().stats(self.id)

    @property
    def n_past(self) -> int:
        return int(self.stats()["n_past"])

    def close(self) -> None:
        """Frees the native sequence (idempotent; a no-op once the engine is closed)."""
        if not self._open:
            return
        self._open = False
        eng = self.engine._native
        if eng is not None:
            eng.free_sequence(self.id)

    def __enter__(self) -> Sequence:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
