"""The `specd` command line (worker.cli.main with capsys) and worker.perplexity.

CLI calls load the demo model each time (as the command does), so they are few. The
perplexity windowing rule is checked exactly against the float64 reference forward on a
tiny random model, where windows are cheap.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from worker.cli import main

REPO = Path(__file__).resolve().parents[2]
EXACT_TEXT = REPO / "tests" / "data" / "exact_text.txt"
EXACT_IDS = REPO / "tests" / "data" / "exact_text.ids.json"


@pytest.fixture(scope="module", autouse=True)
def parse_each_file_once():
    """gguf's reader takes seconds to parse the demo's 49k-entry vocabulary, and every CLI
    call opens the model again (as the real command does): share the parsed, read-only
    ModelFile between calls so this module pays for it once. Everything after the parse
    (tokenizer, template, engine) is still built per call."""
    import functools

    import worker.model_file

    cached = functools.lru_cache(maxsize=4)(worker.model_file.open_model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker.model_file, "open_model", lambda path: cached(str(path)))
        yield


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------- no engine needed

def test_help_needs_neither_numpy_nor_the_engine():
    code = (
        "import sys\n"
        "from worker.cli import main\n"
        "for argv in (['--help'], ['generate', '--help'], ['perplexity', '--help'], ['models', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (argv, e.code)\n"
        "print('loaded:', [m for m in ('numpy', 'worker._specd', 'worker.engine') if m in sys.modules])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert "loaded: []" in res.stdout
    assert "--temperature" in res.stdout and "--ctx-size" in res.stdout and "--file" in res.stdout


def test_errors_are_one_line_with_exit_code_2(capsys, tmp_path):
    missing = tmp_path / "missing.gguf"
    rc, out, err = run_cli(capsys, "generate", "--model", missing, "--prompt", "hi")
    assert rc == 2 and out == ""
    assert err == (f"error: model '{missing}' is not a known name (known: demo) nor an existing .gguf "
                   f"file; no file at {missing}\n")
    rc, out, err = run_cli(capsys, "generate", "--model", missing, "--prompt", "hi", "--temperature", "3")
    assert rc == 2 and err == "error: temperature must be between 0 and 2 (0 = greedy), got 3.0\n"
    rc, out, err = run_cli(capsys, "generate", "--prompt", "hi", "--top-p", "0")
    assert rc == 2 and err.startswith("error: top_p must be greater than 0 and at most 1")
    rc, out, err = run_cli(capsys, "generate", "--prompt", "hi", "--presence-penalty", "-2.5")
    assert rc == 2 and err.startswith("error: presence_penalty must be between -2 and 2")
    rc, out, err = run_cli(capsys, "generate", "--prompt", "hi", "--stop", "")
    assert rc == 2 and err.startswith("error: stop strings must be non-empty")
    rc, out, err = run_cli(capsys, "perplexity", "--file", tmp_path / "nope.txt")
    assert rc == 2 and err.startswith("error: cannot read --file") and "Traceback" not in err
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"x")
    rc, out, err = run_cli(capsys, "generate", "--model", not_gguf, "--prompt", "hi")
    assert rc == 2 and "does not end in .gguf" in err and err.count("\n") == 1


def test_bad_flags_are_argparse_usage_errors(capsys):
    for argv in (["generate", "--prompt", "hi", "--max-tokens", "abc"],
                 ["generate", "--prompt", "hi", "--max-tokens", "0"],
                 ["generate"],  # --prompt is required
                 ["generate", "--prompt", "hi", "--kv-type", "q4"],
                 ["frobnicate"],
                 []):
        with pytest.raises(SystemExit) as ei:
            main(argv)
        assert ei.value.code == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("usage: specd") and "error:" in err, argv


def test_models_list_and_pull(capsys, demo_model_path, monkeypatch):
    monkeypatch.setenv("SPECD_HOME", str(demo_model_path.parent.parent))
    rc, out, _ = run_cli(capsys, "models", "list")
    assert rc == 0
    assert any(line.startswith("demo ") and line.endswith(f" {demo_model_path}") for line in out.splitlines()), out
    rc, out, _ = run_cli(capsys, "models", "pull", "demo", "--quiet")
    assert rc == 0 and out == f"{demo_model_path}\n"
    rc, out, err = run_cli(capsys, "models", "pull", "llama-9000")
    assert rc == 2 and err == "error: unknown model 'llama-9000'; known: demo\n"


# ---------------------------------------------------------------- the demo model

def test_generate_json_fields_and_types(capsys, demo_model_path):
    rc, out, err = run_cli(capsys, "generate", "--model", demo_model_path, "--prompt", "The capital of France is",
                           "--temperature", "0", "--max-tokens", "6", "--json")
    assert rc == 0, err
    assert out.count("\n") == 1  # one JSON object, nothing streamed around it
    r = json.loads(out)
    assert r["text"].startswith(" Paris"), r["text"]
    assert isinstance(r["tokens"], list) and all(isinstance(t, int) for t in r["tokens"])
    assert isinstance(r["prompt_tokens"], list) and all(isinstance(t, int) for t in r["prompt_tokens"])
    assert len(r["tokens"]) == r["n_generated"] and 1 <= r["n_generated"] <= 6
    assert len(r["prompt_tokens"]) == r["n_prompt"] > 0
    assert r["finish_reason"] in ("stop", "length")
    assert r["finish_reason"] == "length" or r["tokens"][-1] in (0, 1, 2)
    for key in ("prefill_tok_s", "decode_tok_s"):
        assert isinstance(r[key], float) and r[key] > 0
    assert isinstance(r["seed"], int)


def test_generate_chat_streams_the_answer(capsys, demo_model_path):
    rc, out, err = run_cli(capsys, "generate", "--model", demo_model_path, "--chat", "--prompt",
                           "What is the capital of France?")  # the defaults: greedy, 128 tokens
    assert rc == 0, err
    assert "Paris" in out and out.endswith("\n")
    assert "<|im_end|>" not in out
    assert "prompt:" in err and "tok/s" in err and "finish:" in err


def test_perplexity_on_the_demo_model(capsys, demo_model_path):
    """The float64 reference forward (tests/helpers/reference.py, run by test_demo_exact.py)
    gives perplexity 17.5608 on these 297 ids (no BOS). With an f32 KV cache the engine
    differs from it only by float32 rounding (measured 17.5609), so +-0.01 (6e-4 relative)
    is generous, yet an off-by-one between logits and targets, a wrong window or a
    float32 log-softmax overflow would be far outside it."""
    rc, out, err = run_cli(capsys, "perplexity", "--model", demo_model_path, "--file", EXACT_TEXT,
                           "--kv-type", "f32", "--json")
    assert rc == 0, err
    r = json.loads(out)
    ids = json.loads(EXACT_IDS.read_text())["ids"]
    assert r["token_ids"] == ids
    assert math.isfinite(r["ppl"]) and r["n_tokens"] == len(ids) - 1
    assert len(r["argmax"]) == len(r["token_ids"]) and len(r["nll"]) == r["n_tokens"]
    assert all(0 <= a < 49152 for a in r["argmax"])
    assert r["ppl"] == pytest.approx(17.5608, abs=0.01)
    assert r["ppl"] == pytest.approx(math.exp(sum(r["nll"]) / len(r["nll"])))
    # The model often predicts the next word of plain English: argmax agrees with the text.
    agree = np.mean(np.asarray(r["argmax"][:-1]) == np.asarray(ids[1:]))
    assert agree > 0.3, agree

    # Windows (the text does not fit 64 tokens): still every token scored once.
    rc, out, err = run_cli(capsys, "perplexity", "--model", demo_model_path, "--file", EXACT_TEXT,
                           "--ctx-size", "64")
    assert rc == 0, err
    line = out.strip()
    assert line.startswith("perplexity: ") and line.endswith(f" over {len(ids) - 1} tokens")
    assert math.isfinite(float(line.split()[1]))


# ---------------------------------------------------------------- perplexity rule vs reference

def test_windows_cover_every_token_once():
    from worker.perplexity import windows

    for n in range(2, 60):
        for n_ctx in (2, 3, 4, 7, 8, 16, 64):
            ws = windows(n, n_ctx)
            scored = [t for (_, end, first) in ws for t in range(first, end)]
            assert scored == list(range(1, n)), (n, n_ctx)
            for start, end, first in ws:
                assert end - start <= n_ctx and start < first <= end
                if start > 0:  # later windows: at least half a window of context
                    assert first - start >= n_ctx - n_ctx // 2


def test_score_tokens_matches_float64_reference(tmp_path):
    """Engine (kv f32) vs the float64 reference forward, window by window, on a tiny random
    llama. Each nll = logsumexp(z) - z[t] moves by at most 2 max|dz|; the engine's logits are
    within 1e-4 * max|z| of the reference (tests/native/test_model_logits.py), so nll agrees
    to 2e-4 * max|z| + float64 noise."""
    from helpers.reference import ReferenceModel, log_softmax
    from helpers.tiny_gguf import write_tiny_model
    from worker.engine import Engine
    from worker.model_file import open_model
    from worker.perplexity import score_tokens, windows

    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 31))
    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", "Q8_0", seed=seed)
    ids = rng.integers(0, 300, size=45).tolist()
    ref = ReferenceModel(path)

    def ref_nll(n_ctx):
        out = np.full(len(ids) - 1, np.nan)
        zmax = 0.0
        for start, end, first in windows(len(ids), n_ctx):
            z = ref.logits(ids[start:end])
            zmax = max(zmax, float(np.abs(z).max()))
            lp = log_softmax(z)
            for t in range(first, end):
                out[t - 1] = -lp[t - 1 - start, ids[t]]
        return out, zmax

    results = {}
    for n_ctx, chunk in ((64, 256), (64, 7), (16, 5)):
        engine = Engine(open_model(path), n_ctx=n_ctx, kv_type="f32")
        try:
            r = score_tokens(engine, ids, chunk=chunk)
        finally:
            engine.close()
        want, zmax = ref_nll(n_ctx)
        tol = 2e-4 * zmax + 1e-9
        err = np.abs(np.asarray(r.nll) - want).max()
        assert err <= tol, f"n_ctx {n_ctx} chunk {chunk}: nll error {err:.3g} > {tol:.3g} (seed {seed})"
        assert r.ppl == pytest.approx(math.exp(want.mean()), rel=tol)
        assert r.n_tokens == len(ids) - 1 and r.token_ids == ids and r.window == n_ctx
        assert len(r.argmax) == len(ids)
        results[n_ctx] = (np.asarray(r.nll), tol)
    # Not vacuous: the short windows really score with less context than one sequence.
    short, tol = results[16]
    full, _ = results[64]
    assert np.abs(short[15:] - full[15:]).max() > 10 * tol, f"windows changed nothing (seed {seed})"
    assert np.allclose(short[:15], full[:15], rtol=0, atol=2 * tol)  # the first window is shared


def test_generate_with_a_draft_is_lossless_and_reports_acceptance(capsys, demo_model_path):
    """--draft ngram / --draft-k: the same greedy tokens as without speculation, plus the
    speculation counters in --json."""
    prompt = "List the numbers one, two, three, one, two, three, one, two,"
    common = ["generate", "--model", demo_model_path, "--prompt", prompt, "--max-tokens", "24", "--json"]
    rc, out, err = run_cli(capsys, *common)
    assert rc == 0, err
    plain = json.loads(out)
    rc, out, err = run_cli(capsys, *common, "--draft", "ngram", "--draft-k", "3")
    assert rc == 0, err
    spec = json.loads(out)
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"]
    assert plain["drafted"] == plain["accepted"] == 0
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    assert spec["acceptance_length"] >= 1.0


def test_generate_rejects_a_bad_draft_k(capsys, demo_model_path):
    rc, out, err = run_cli(capsys, "generate", "--model", demo_model_path, "--prompt", "hi",
                           "--draft", "ngram", "--draft-k", "0")
    assert rc == 2 and err.startswith("error: ") and "draft_k" in err.replace("-", "_"), err
