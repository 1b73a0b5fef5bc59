"""Generation policy around the engine: prompt -> tokens -> streamed text deltas.

The C++ engine samples tokens; everything a user would call policy lives here: chat
templating, the context-length check, stop tokens, stop strings, max_tokens,
detokenization and the timing report. Python runs once per engine step (1 token today,
1..k+1 with speculative decoding), never per vocabulary entry.

Stopping rules (checked token by token, in order, so a stop inside a multi-token step
cuts there and the step's later tokens are dropped from the output and the KV cache):
  1. a token in tokenizer.stop_ids (EOS, end-of-turn): finish 'stop'; the token counts as
     generated but adds no text;
  2. a stop string completes in the text: finish 'stop'; the text ends exactly before it
     (if several complete within one token, the earliest-starting one wins);
  3. max_tokens tokens generated: finish 'length'.
Text that might still turn out to be the start of a stop string is held back (at most
len(longest stop) - 1 characters) until the next tokens settle it.

Speculative decoding (Generator(draft=PATH|name|"ngram", draft_k=K)): the engine drafts
up to K tokens per step and verifies them in one target forward; output is unchanged
(greedy: the same tokens; sampling: the same distribution). Stats report drafted /
accepted draft tokens and the acceptance length tau = mean tokens per speculative step.
Speculation only pays where a verify of k + 1 positions costs less than tau plain steps, so
by default (adaptive) a SpeculationGovernor times both kinds of step on each generation and
keeps the faster: speculative steps while drafts are accepted often enough, plain steps
otherwise, trying the other kind again now and then.

Timing definitions (engine-side clocks, Python overhead excluded):
  prefill_tok_s = n_prompt / prefill_seconds  (the prompt forward)
  decode_tok_s  = (n_generated - 1) / decode_seconds
The first generated token is sampled from the prefill's logits (no forward of its own),
so decode_seconds -- the time of the steps' work: inside step(), and on a GPU, where each
greedy step queues the next token's forward before returning (run-ahead), that forward's
device time instead of the wait for it -- pays for the other n_generated - 1.
Either rate is 0.0 when it is not measurable (no time, or fewer than 2 tokens).
"""

from __future__ import annotations

import dataclasses
import operator
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from worker.errors import InvalidRequestError, SpecdError
from worker.protocol import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"

# Verifies of at least this many positions are cheaper on the tensor-core reader for F16
# weights (Engine(tensor_cores=True)) than on the CUDA cores; shorter ones are not, and its
# single step is ~1.9x slower. H200, Qwen3-0.6B shape in F16, one call
# (bench/results/gpu_nvidia-h200_20261201_tc-f16-units.json), tensor cores against CUDA cores:
# a step 1312 / 701 us, 5 positions 1828 / 1770, 9 positions 2343 / 2550, 16 2695 / 3373. No
# other weight type gains from it (BF16 even leaves its direct reader for a staged one).
TENSOR_CORE_MIN_POSITIONS = 9
_GGML_F16 = 1  # gguf.GGMLQuantizationType.F16


def tensor_cores_pay(model_file, mode: str, draft_k: int) -> bool:
    """Whether a Generator's engine should read its target's weights on tensor cores: it
    speculates (mode != "none") with verifies of TENSOR_CORE_MIN_POSITIONS or more (draft_k
    + 1) and every matrix of its layers is F16. Fixed for the engine's life (decode and verify
    rows must come from one reader: batch invariance), so a request's own draft_k does not
    change it."""
    if mode == "none" or draft_k + 1 < TENSOR_CORE_MIN_POSITIONS:
        return False
    mats = [t for t in model_file.tensors if t[0].startswith("blk.") and len(t[2]) == 2]
    return bool(mats) and all(t[1] == _GGML_F16 for t in mats)


@dataclasses.dataclass(frozen=True)
class Stats:
    """Counts and timings of one generation (see the module header for the rates)."""

    n_prompt: int
    n_generated: int
    prefill_seconds: float
    decode_seconds: float
    prefill_tok_s: float
    decode_tok_s: float
    seed: int  # the seed actually used (drawn at random when the request gave none)
    drafted: int = 0               # draft tokens proposed (0 without speculation)
    accepted: int = 0              # of which the target accepted
    acceptance_length: float = 0.0  # tau: mean tokens returned per speculative step


@dataclasses.dataclass(frozen=True)
class Delta:
    """One engine step's contribution. `text` may be '' (held back, special tokens);
    the last delta has finish_reason set and carries the stats."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: Stats | None = None


@dataclasses.dataclass(frozen=True)
class Result:
    text: str
    tokens: list[int]          # generated ids, including a final stop token if one ended it
    prompt_tokens: list[int]
    finish_reason: str         # 'stop' | 'length'
    prefill_tok_s: float
    decode_tok_s: float
    n_prompt: int
    n_generated: int
    prefill_seconds: float
    decode_seconds: float
    seed: int
    drafted: int = 0
    accepted: int = 0
    acceptance_length: float = 0.0


NGRAM = "ngram"  # Generator(draft=NGRAM): prompt-lookup drafting, no draft model
MAX_DRAFT_K = 32  # = worker.engine.MAX_DRAFT (engine.h kMaxDraft; this module imports no native code)


class SpeculationGovernor:
    """Keeps a sequence's speculation on only while it is the faster way to decode.

    Speculation changes speed, never the output, and it can lose: where verifying k + 1
    positions costs several plain steps (2.5-3.5 for k = 4 on the H200's int8 readers) or the
    drafts are rejected (text the n-gram table has not seen, a poor draft model), a plain step
    returns tokens faster. The governor times the engine's step() calls (wall clock: what a
    client waits on; work the device overlaps with the host is free, as it is to the client)
    and keeps, per mode, the tokens per second of the last `window` steps of its latest run,
    leaving out the run's first step (it pays the switch: the draft catching up, forwards
    queued ahead dropped).
    It speculates for `warm` steps, steps plainly for `probe`, then keeps the faster mode,
    trying the other again for `probe` steps after `period` steps, then after twice as many
    each time the kept mode stays the faster (up to `max_period`; back to `period` after a
    change: how well drafts fare moves with the text); it changes only when the other mode is
    more than `margin` faster.
    speculate() says what the next step should do; observe() takes what a step did."""

    def __init__(self, *, warm: int = 4, probe: int = 3, period: int = 32, max_period: int = 256,
                 window: int = 8, margin: float = 0.05):
        self.warm, self.probe, self.period, self.window, self.margin = warm, probe, period, window, margin
        self.max_period = max(max_period, period)
        self._period = period  # the next run of the kept mode (doubles while probes confirm it)
        self._rates: dict[bool, list[tuple[int, float]]] = {True: [], False: []}
        self._best = True    # the mode kept between probes
        self._mode = True    # the mode of the current run of steps
        self._left = warm    # steps left in this run
        self._probing = False  # this run tries the mode that is not kept
        self._fresh = True   # the run's first step is still to come

    def speculate(self) -> bool:
        return self._mode

    def rate(self, speculating: bool) -> float | None:
        """Tokens per second of the mode's recent steps (None before any)."""
        obs = self._rates[speculating]
        secs = sum(s for _, s in obs)
        return sum(n for n, _ in obs) / secs if obs and secs > 0 else None

    def observe(self, speculating: bool, tokens: int, seconds: float) -> None:
        if speculating != self._mode:
            raise ValueError("observe() of a step in the mode speculate() did not ask for")
        if self._fresh:  # a new run of this mode: its rate is this run's from now on
            self._fresh = False
            self._rates[speculating].clear()
        else:
            obs = self._rates[speculating]
            obs.append((tokens, seconds))
            del obs[:-self.window]
        self._left -= 1
        if self._left > 0:
            return
        if self._probing:  # both modes timed lately: keep the faster
            kept, other = self.rate(self._best), self.rate(not self._best)
            if kept is not None and other is not None and other > kept * (1 + self.margin):
                self._best, self._period = not self._best, self.period
            self._mode, self._left, self._probing = self._best, self._period, False
            self._period = min(2 * self._period, self.max_period)  # (a kept mode is probed less often)
        else:  # try the other mode
            self._mode, self._left, self._probing = not self._best, self.probe, True
        self._fresh = True


class StopMatcher:
    """Cuts streamed text before the first stop string, holding back a possible prefix.

    push(text) -> (safe_text, stopped). Invariant: everything returned so far contains no
    position where a stop string starts, because the held-back tail is the longest suffix
    of the text that is a proper prefix of some stop string (so < len(longest stop) chars).
    """

    def __init__(self, stops: Sequence[str]):
        for s in stops:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}")
        self._stops = tuple(dict.fromkeys(stops))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail, once no more text will come (it never became a stop)."""
        out, self._held = self._held, ""
        return out

    def _partial_tail(self, buf: str) -> int:
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


def _rate(n: int, seconds: float) -> float:
    return n / seconds if n > 0 and seconds > 0 else 0.0


class Generator:
    """One resident model: GGUF file, engine, tokenizer and chat template, loaded once.

    Engine and tokenizer modules are imported here, not at module import, so the pure
    parts of this file (StopMatcher) work without numpy or the native build.

    draft: None (no speculation), "ngram" (prompt lookup), or a draft model (a path or
    a model name, as for `model`) sharing the target's token table; draft_k: tokens drafted
    per step (1..32), the default of every generate() call. On a GPU, draft_k >= 8 with F16
    weights puts the target on the tensor-core reader (tensor_cores_pay). adaptive: a
    SpeculationGovernor per generation keeps speculating only while it decodes faster than
    plain steps (the output is the same either way: greedy the same tokens, sampling the same
    distribution; a sampling request with its own seed speculates on every step, so that it
    stays reproducible); False speculates on every step.
    """

    draft_mode: str = "none"  # "none" | "ngram" | "draft" (set from `draft` in __init__)
    draft_k: int = 4
    adaptive: bool = True

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        kv_type: str = "f16",
        draft: str | os.PathLike | None = None,
        draft_k: int = 4,
        device: str = "cpu",
        adaptive: bool = True,
    ):
        from worker.models import resolve_model

        if n_ctx is not None and n_ctx < 1:
            raise InvalidRequestError(f"context size must be >= 1 token, got {n_ctx}")
        if n_threads is not None and n_threads < 1:
            raise InvalidRequestError(f"thread count must be >= 1, got {n_threads}")
        if kv_type not in ("f16", "f32"):
            raise InvalidRequestError(f"kv_type must be 'f16' or 'f32', got {kv_type!r}")
        _check_draft_k(draft_k)
        self.path: Path = resolve_model(model)
        from worker.chat_template import ChatTemplate
        from worker.engine import Engine
        from worker.model_file import open_model
        from worker.tokenizer import Tokenizer

        self.model_file = open_model(self.path)
        self.tokenizer = Tokenizer.from_metadata(self.model_file.metadata)
        self._template = None
        self._template_error: SpecdError | None = None
        try:
            self._template = ChatTemplate.from_metadata(self.model_file.metadata, self.tokenizer)
        except SpecdError as exc:  # a model without a template still does raw completion
            self._template_error = exc
        self.draft_k = draft_k
        self.adaptive = adaptive
        self.draft_mode = "none"
        self.draft_path: Path | None = None
        self.draft_file = None
        if draft is not None and str(draft) == NGRAM:
            self.draft_mode = NGRAM
        elif draft is not None:
            self.draft_path = resolve_model(draft)
            self.draft_file = open_model(self.draft_path)
            # a DFlash block drafter (docs/dflash-gguf.md) drafts up to block_size - 1 tokens
            self.draft_mode = "dflash" if self.draft_file.config.arch == "dflash" else "draft"
        self.engine = Engine(
            self.model_file, n_ctx=n_ctx, n_threads=n_threads, kv_type=kv_type, draft_model=self.draft_file,
            device=device, tensor_cores=tensor_cores_pay(self.model_file, self.draft_mode, draft_k),
        )
        self._stop_ids = frozenset(int(t) for t in self.tokenizer.stop_ids)

    @property
    def n_ctx(self) -> int:
        return int(self.engine.n_ctx)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- prompts ----

    def prompt_ids(self, prompt: str | Sequence[int] | Sequence[dict], *, chat: bool = False) -> list[int]:
        """Token ids for a raw text prompt, a list of ids, or (chat=True) a user message
        string or a list of {'role', 'content'} messages rendered by the model's template.

        Raw text is tokenized with the model's own BOS rule and special-token text kept
        literal; a rendered chat prompt parses special tokens (the template writes them)."""
        if chat:
            if self._template is None:
                raise InvalidRequestError(f"this model has no usable chat template: {self._template_error}")
            if isinstance(prompt, str):
                messages = [{"role": "user", "content": prompt}]
            elif all(isinstance(m, dict) for m in prompt):
                messages = list(prompt)
            else:
                raise InvalidRequestError("a chat prompt is a string or a list of {role, content} messages")
            text = self._template.render(messages, add_generation_prompt=True)
            ids = list(self.tokenizer.encode(text, add_special=True, parse_special=True))
            bos = self.tokenizer.bos_id
            if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
                ids = ids[1:]  # the template wrote BOS and the tokenizer added another
        elif isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special=True, parse_special=False))
        else:
            try:
                ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise InvalidRequestError(
                    "a prompt is a string or a list of token ids (chat=True also takes messages)"
                ) from None
            n_vocab = int(self.engine.n_vocab)
            bad = [t for t in ids if not 0 <= t < n_vocab]
            if bad:
                raise InvalidRequestError(f"token ids must be in [0, {n_vocab}), got {bad[:5]}")
        if not ids:
            raise InvalidRequestError("the prompt is empty (0 tokens); give at least one token")
        return ids

    # ---- generation ----

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        chat: bool = False,
        max_tokens: int = 128,
        params: SamplingParams | None = None,
        stop: Sequence[str] = (),
        draft_k: int | None = None,
    ) -> Iterator[Delta]:
        """Validates everything now (errors raise here, before any output), then returns
        an iterator of Deltas; closing it early frees the sequence. draft_k overrides the
        Generator's for this call (0 = no speculation; ignored without a drafter)."""
        params = (params or SamplingParams()).validate()
        k = self.draft_k if draft_k is None else draft_k
        if draft_k is not None and draft_k != 0:
            _check_draft_k(draft_k)
        mode = self.draft_mode if k else "none"
        if isinstance(stop, str):
            stop = [stop]
        matcher = StopMatcher(stop)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        ids = self.prompt_ids(prompt, chat=chat)
        if len(ids) + max_tokens > self.n_ctx:
            raise InvalidRequestError(
                f"context length exceeded: prompt has {len(ids)} tokens + max_tokens {max_tokens} "
                f"> context {self.n_ctx}; shorten the prompt, lower max_tokens or raise the "
                f"context size (--ctx-size)"
            )
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        native_params = params.to_native(seed)
        # The governor's choices follow the clock, and a speculative step draws other random
        # numbers than a plain one: a request that samples with its own seed, which must come
        # out the same every time, speculates on every step instead.
        adaptive = self.adaptive and (params.temperature == 0 or params.seed is None)
        return self._run(ids, max_tokens, native_params, matcher, seed, mode, k, adaptive)

    def _run(self, ids: list[int], max_tokens: int, native_params: dict, matcher: StopMatcher,
             seed: int, mode: str = "none", draft_k: int = 0, adaptive: bool = False) -> Iterator[Delta]:
        from worker.detokenizer import IncrementalDetokenizer

        detok = IncrementalDetokenizer(self.tokenizer, skip_special=True)
        seq = self.engine.new_sequence()
        try:
            seq.set_sampling(native_params)
            if mode != "none":
                seq.set_speculation(mode, draft_k)
            seq.prefill(ids)
            # (only a drafter the engine keeps while paused is governed: not DFlash, which
            # proposes nothing after plain steps, whose hidden states it was not given)
            gov = SpeculationGovernor() if adaptive and mode != "none" and seq.speculation_pausable() else None
            speculating = mode != "none"
            n_gen = 0
            finish: str | None = None
            while finish is None:
                if gov is not None and gov.speculate() != speculating:
                    speculating = gov.speculate()
                    seq.set_speculation(mode if speculating else "none", draft_k)
                t0 = time.perf_counter()
                step = [int(t) for t in seq.step()]
                if gov is not None:
                    gov.observe(speculating, len(step), time.perf_counter() - t0)
                if not step:
                    raise SpecdError("engine step returned no tokens")
                accepted: list[int] = []
                text = []
                stopped_by_string = False
                for t in step:
                    accepted.append(t)
                    n_gen += 1
                    if t in self._stop_ids:
                        finish = FINISH_STOP
                        break
                    out, stopped_by_string = matcher.push(detok.push([t]))
                    text.append(out)
                    if stopped_by_string:
                        finish = FINISH_STOP
                        break
                    if n_gen >= max_tokens:
                        finish = FINISH_LENGTH
                        break
                if finish is not None and not stopped_by_string:
                    # No more tokens: settle the detokenizer's partial bytes, then release
                    # the held-back tail (a stop may still complete inside the flush).
                    out, stopped_by_string = matcher.push(detok.flush())
                    text.append(out)
                    if stopped_by_string:
                        finish = FINISH_STOP
                    else:
                        text.append(matcher.flush())
                if len(accepted) < len(step):
                    # Drop the step's tokens after the stop from the KV cache, so the
                    # sequence holds exactly prompt + accepted output (for later reuse).
                    seq.truncate(min(int(seq.stats()["n_past"]), len(ids) + n_gen))
                stats = self._stats(seq, len(ids), n_gen, seed) if finish is not None else None
                yield Delta("".join(text), accepted, finish, stats)
        finally:
            seq.close()

    @staticmethod
    def _stats(seq, n_prompt: int, n_gen: int, seed: int) -> Stats:
        st = seq.stats()
        pre, dec = float(st["prefill_seconds"]), float(st["decode_seconds"])
        return Stats(
            n_prompt=n_prompt,
            n_generated=n_gen,
            prefill_seconds=pre,
            decode_seconds=dec,
            prefill_tok_s=_rate(n_prompt, pre),
            decode_tok_s=_rate(n_gen - 1, dec),
            seed=seed,
            drafted=int(st.get("drafted", 0)),
            accepted=int(st.get("accepted", 0)),
            acceptance_length=float(st.get("acceptance_length", 0.0)),
        )

    def complete(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        chat: bool = False,
        max_tokens: int = 128,
        params: SamplingParams | None = None,
        stop: Sequence[str] = (),
        draft_k: int | None = None,
    ) -> Result:
        """generate() run to the end, collected into one Result."""
        ids = self.prompt_ids(prompt, chat=chat)
        texts: list[str] = []
        tokens: list[int] = []
        last: Delta | None = None
        for d in self.generate(ids, max_tokens=max_tokens, params=params, stop=stop, draft_k=draft_k):
            texts.append(d.text)
            tokens.extend(d.token_ids)
            last = d
        assert last is not None and last.stats is not None and last.finish_reason is not None
        s = last.stats
        return Result(
            text="".join(texts),
            tokens=tokens,
            prompt_tokens=ids,
            finish_reason=last.finish_reason,
            prefill_tok_s=s.prefill_tok_s,
            decode_tok_s=s.decode_tok_s,
            n_prompt=s.n_prompt,
            n_generated=s.n_generated,
            prefill_seconds=s.prefill_seconds,
            decode_seconds=s.decode_seconds,
            seed=s.seed,
            drafted=s.drafted,
            accepted=s.accepted,
            acceptance_length=s.acceptance_length,
        )


def _check_draft_k(k: object) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_K:
        raise InvalidRequestError(f"draft_k must be an integer in 1..{MAX_DRAFT_K} draft tokens per step, got {k!r}")
