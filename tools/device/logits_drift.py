"""How far builds of the engine drift from a reference build on the same model (tools/device:
the GPU machine), e.g. builds with fewer digit planes of x (-DSPECD_X_PLANES=2|1) against the
default's float32-accurate three.

    python3 tools/device/logits_drift.py run OUT.npz MODEL.gguf     # in each build's environment
    python3 tools/device/logits_drift.py compare REF.npz OTHER.npz ...

`run` opens the model on cuda:0, prefills a fixed prompt of 48 token ids (a forward of <= 64
positions: the decode / verify kernels, not the tensor-core prefill) keeping every position's
logits, then takes 64 greedy steps, and stores the logits and the tokens. `compare` prints per
other file: the prompt logits' largest |difference| relative to the reference row's largest
|logit| (max over rows) and the RMS of the difference relative to the rows' RMS, the prompt rows
whose argmax differs, and the first greedy step whose token differs (- where none does).
"""
import sys

import numpy as np

PROMPT, STEPS = 48, 64


def run(out: str, model: str) -> None:
    from worker.engine import Engine
    from worker.model_file import open_model

    with Engine(open_model(model), device="cuda:0", n_ctx=256) as eng:
        ids = np.random.default_rng(7).integers(0, eng.n_vocab, PROMPT).astype(np.int32)
        seq = eng.new_sequence()
        seq.set_sampling({"temperature": 0.0})  # greedy (the default samples at temperature 1)
        logits = seq.prefill(ids, all_logits=True)
        tokens = [t for _ in range(STEPS) for t in seq.step()]
    np.savez(out, logits=logits, tokens=np.asarray(tokens[:STEPS], dtype=np.int64))
    print(f"logits_drift: {out}: {logits.shape[0]} prompt rows, {len(tokens)} greedy tokens", flush=True)


def drift(ref: dict, other: dict) -> dict:
    """The measures of `compare` for one pair of stored runs (mappings with logits and tokens)."""
    a, b = np.asarray(ref["logits"], np.float64), np.asarray(other["logits"], np.float64)
    if a.shape != b.shape:
        raise ValueError(f"logits of shapes {a.shape} and {b.shape}: not runs of one model")
    d = np.abs(b - a)
    diff = np.nonzero(np.asarray(ref["tokens"]) != np.asarray(other["tokens"]))[0]
    return {
        "max_rel": float((d.max(1) / np.abs(a).max(1)).max()),
        "rms_rel": float(np.sqrt((d**2).mean() / (a**2).mean())),
        "argmax_diff": int((a.argmax(1) != b.argmax(1)).sum()),
        "rows": len(a),
        "first_token_diff": int(diff[0]) if diff.size else None,
    }


def compare(ref_path: str, others: list[str]) -> None:
    ref = np.load(ref_path)
    print(f"{'build':40} {'max rel':>10} {'rms rel':>10} {'argmax diff':>12} {'first token diff':>17}")
    for path in others:
        r = drift(ref, np.load(path))
        first = "-" if r["first_token_diff"] is None else str(r["first_token_diff"])
        print(f"{path:40} {r['max_rel']:10.3g} {r['rms_rel']:10.3g} {r['argmax_diff']:>8} / {r['rows']:<3} {first:>17}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 4 and sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
