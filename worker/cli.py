"""The `specd` command line: argument parsing and printing, nothing else.

Subcommands: `models pull|list`, `generate`, `perplexity`. Each one is an `_add_<name>`
function that registers its parser and handler, so later issues add `up`, `worker` and
`gateway` the same way. Only argparse and worker.errors are imported at module level:
engine, tokenizer and numpy load inside the handlers, so `specd --help` (and the gateway
image, which has no native build) never touch them.

Errors specd raises on purpose (SpecdError) print one line `error: ...` on stderr and
exit with status 2, like argparse's usage errors; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from worker.errors import SpecdError

EXIT_ERROR = 2


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", "-m", default="demo",
                   help="a known model name (demo) or a path to a .gguf file (default: demo)")
    g.add_argument("--threads", "-t", type=_positive_int, default=None,
                   help="CPU threads (default: all cores)")
    g.add_argument("--ctx-size", "-c", type=_positive_int, default=None,
                   help="context length in tokens (default: min(model's training context, 4096))")
    g.add_argument("--kv-type", choices=("f16", "f32"), default="f16",
                   help="KV cache precision (default: f16; f32 is exact)")


def _load(args: argparse.Namespace):
    from worker.generate import Generator

    return Generator(args.model, n_ctx=args.ctx_size, n_threads=args.threads, kv_type=args.kv_type)


# ---- specd models ----

def _add_models(sub) -> None:
    p = sub.add_parser("models", help="fetch and list cached models")
    msub = p.add_subparsers(dest="models_cmd", metavar="{pull,list}", required=True)
    pull = msub.add_parser("pull", help="download and verify a known model; prints its path")
    pull.add_argument("name", nargs="?", default="demo", help="model name (default: demo)")
    pull.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    pull.set_defaults(func=_cmd_models_pull)
    lst = msub.add_parser("list", help="models in the local cache ($SPECD_HOME)")
    lst.set_defaults(func=_cmd_models_list)


def _cmd_models_pull(args: argparse.Namespace) -> int:
    from worker.errors import InvalidRequestError
    from worker.models import KNOWN_MODELS, pull

    if args.name not in KNOWN_MODELS:
        raise InvalidRequestError(f"unknown model {args.name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    print(pull(KNOWN_MODELS[args.name], progress=not args.quiet))
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    from worker.models import list_cached, models_dir

    found = list_cached()
    if not found:
        print(f"no models cached in {models_dir()} (fetch one: specd models pull demo)")
        return 0
    width = max(len(name) for name, _, _ in found)
    for name, path, size in found:
        print(f"{name:<{width}}  {size / 2**20:8.1f} MiB  {path}")
    return 0


# ---- specd generate ----

def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Streams the continuation of --prompt to stdout (timings to stderr). "
        "Decoding is greedy by default (deterministic, like a test harness); pass "
        "--temperature T (0..2) to sample, with every filter off unless set.",
    )
    _engine_flags(p)
    p.add_argument("--prompt", "-p", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template")
    p.add_argument("--max-tokens", "-n", type=_positive_int, default=128,
                   help="most tokens to generate (default: 128)")
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0,
                   help="0..2 (default: 0 = greedy; the HTTP API keeps OpenAI's default of 1.0)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default: 1 = off)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    s.add_argument("--min-p", type=float, default=0.0, help="keep p >= min_p * p_max, 0..1 (default: 0 = off)")
    s.add_argument("--seed", type=int, default=None, help="RNG seed (default: random, printed with the timings)")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0 (default: 1 = off)")
    s.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2 (default: 0)")
    s.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2 (default: 0)")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeatable)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, tokens, prompt_tokens, finish_reason, timings) at the end")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from worker.protocol import SamplingParams

    # Validate cheap things before loading the model.
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    ).validate()
    from worker.generate import StopMatcher

    StopMatcher(args.stop)
    gen = _load(args)
    try:
        ids = gen.prompt_ids(args.prompt, chat=args.chat)
        if args.json:
            r = gen.complete(ids, max_tokens=args.max_tokens, params=params, stop=args.stop)
            print(json.dumps({
                "text": r.text,
                "tokens": r.tokens,
                "prompt_tokens": r.prompt_tokens,
                "finish_reason": r.finish_reason,
                "prefill_tok_s": r.prefill_tok_s,
                "decode_tok_s": r.decode_tok_s,
                "n_prompt": r.n_prompt,
                "n_generated": r.n_generated,
                "prefill_seconds": r.prefill_seconds,
                "decode_seconds": r.decode_seconds,
                "seed": r.seed,
                "model": str(gen.path),
            }, ensure_ascii=False))
            return 0
        out = sys.stdout
        last_text = ""
        stats = finish = None
        for d in gen.generate(ids, max_tokens=args.max_tokens, params=params, stop=args.stop):
            if d.text:
                out.write(d.text)
                out.flush()
                last_text = d.text
            stats, finish = d.stats, d.finish_reason
        if not last_text.endswith("\n"):
            out.write("\n")
        out.flush()
        assert stats is not None
        print(
            f"prompt: {stats.n_prompt} tokens, {stats.prefill_tok_s:.1f} tok/s | "
            f"generated: {stats.n_generated} tokens, {stats.decode_tok_s:.1f} tok/s | "
            f"finish: {finish} | seed: {stats.seed}",
            file=sys.stderr,
        )
        return 0
    finally:
        gen.close()


# ---- specd perplexity ----

def _add_perplexity(sub) -> None:
    p = sub.add_parser(
        "perplexity",
        help="perplexity of a model on a text file",
        description="Scores every token of --file after the first (windows of --ctx-size "
        "tokens sliding by half a window when the text does not fit; see worker/perplexity.py).",
    )
    _engine_flags(p)
    p.add_argument("--file", "-f", required=True, help="a UTF-8 text file")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (ppl, n_tokens, token_ids, argmax, nll)")
    p.set_defaults(func=_cmd_perplexity)


def _cmd_perplexity(args: argparse.Namespace) -> int:
    from worker.errors import InvalidRequestError
    from worker.perplexity import perplexity

    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read --file {args.file!r}: {exc}") from None
    gen = _load(args)
    try:
        r = perplexity(gen, text)
    finally:
        gen.close()
    if args.json:
        print(json.dumps({
            "ppl": r.ppl,
            "n_tokens": r.n_tokens,
            "token_ids": r.token_ids,
            "argmax": r.argmax,
            "nll": r.nll,
            "window": r.window,
        }))
    else:
        print(f"perplexity: {r.ppl:.4f} over {r.n_tokens} tokens")
    return 0


# ---- entry point ----

SUBCOMMANDS: list[Callable] = [_add_models, _add_generate, _add_perplexity]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specd", description="specd: speculative LLM inference serving (CPU engine)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SpecdError as exc:
        sys.stdout.flush()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `specd generate ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
