"""The gateway <-> worker wire contract: frozen msgspec Structs, nothing else.

Imports msgspec and worker.errors only (both pure Python), never numpy or the native
module, so the gateway image installs without them; tests/unit/test_protocol.py checks
this in a fresh interpreter.

Compatibility rule: fields are APPENDED (with defaults), never renamed, re-typed or
removed; old workers and gateways must keep decoding each other's messages. New message
kinds (GenerateJob, the tagged Token/Done/Error event union) are added here as new
Structs by later issues. Unknown fields are ignored on decode (msgspec's default) so a
newer sender can talk to an older receiver.
"""

from __future__ import annotations

import math

import msgspec

from worker.errors import InvalidRequestError

# Seeds travel as Python ints; the engine's RNG takes an unsigned 64-bit seed.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to turn logits into tokens. Defaults are OpenAI's (temperature 1, nothing else on).

    Applied by the engine in this order (as vLLM / HF): repetition / presence / frequency
    penalties -> temperature -> top-k -> top-p -> min-p -> renormalise -> draw.
    temperature == 0 means greedy (argmax, lowest token id on ties).
    """

    temperature: float = 1.0          # 0..2; 0 = greedy
    top_p: float = 1.0                # (0, 1]; 1 = off
    top_k: int = 0                    # >= 0; 0 = off
    min_p: float = 0.0                # 0..1; keep p >= min_p * p_max; 0 = off
    seed: int | None = None           # None: the caller picks a random one
    repetition_penalty: float = 1.0   # > 0; CTRL-style over prompt + output; 1 = off
    presence_penalty: float = 0.0     # -2..2 (OpenAI)
    frequency_penalty: float = 0.0    # -2..2 (OpenAI)
    # New fields go below this line, with defaults.

    def validate(self) -> "SamplingParams":
        """Raises InvalidRequestError naming the field, the value and the allowed range."""

        def bad(name: str, value: object, rule: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name} must be {rule}, got {value!r}")

        def finite(name: str, value: float) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, value, "a number")
            if not math.isfinite(value):
                raise bad(name, value, "a finite number")
            return float(value)

        t = finite("temperature", self.temperature)
        if not 0.0 <= t <= 2.0:
            raise bad("temperature", self.temperature, "between 0 and 2 (0 = greedy)")
        p = finite("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise bad("top_p", self.top_p, "greater than 0 and at most 1 (1 = off)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0 = off)")
        m = finite("min_p", self.min_p)
        if not 0.0 <= m <= 1.0:
            raise bad("min_p", self.min_p, "between 0 and 1 (0 = off)")
        r = finite("repetition_penalty", self.repetition_penalty)
        if not r > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "greater than 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = finite(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise bad(name, getattr(self, name), "between -2 and 2 (0 = off)")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise bad("seed", self.seed, "an integer")
            if not _SEED_MIN <= self.seed <= _SEED_MAX:
                raise bad("seed", self.seed, f"an integer between {_SEED_MIN} and {_SEED_MAX}")
        return self

    def to_native(self, default_seed: int) -> dict:
        """The dict Sequence.set_sampling takes. `default_seed` is used when seed is None
        (the caller draws it at random and may report it). Negative seeds map to their
        two's-complement uint64, so every int64 seed is distinct."""
        self.validate()
        seed = default_seed if self.seed is None else self.seed
        return {
            "temperature": float(self.temperature),
            "top_k": int(self.top_k),
            "top_p": float(self.top_p),
            "min_p": float(self.min_p),
            "repetition_penalty": float(self.repetition_penalty),
            "presence_penalty": float(self.presence_penalty),
            "frequency_penalty": float(self.frequency_penalty),
            "seed": int(seed) % 2**64,
        }


# ---------------------------------------------------------------------------------------
# Serving: the job the gateway enqueues, the events the worker streams back, and the
# Redis keys both sides use. Everything the two processes agree on is in this section.
# ---------------------------------------------------------------------------------------

DEFAULT_PREFIX = "specd"
JOB_FUNC = "worker.jobs.run_generate"  # RQ job entry point (a dotted path: no import needed)
EVENT_FIELD = b"e"                     # the one field of each stream entry: msgpack Event


class Keys(msgspec.Struct, frozen=True):
    """Redis names under one prefix (SPECD_REDIS_PREFIX), so several deployments can share
    a Redis. Queues are RQ queues, one per served model."""

    prefix: str = DEFAULT_PREFIX

    def queue(self, model: str) -> str:          # RQ queue name of a model
        return f"{self.prefix}:model:{model}"

    def events(self, request_id: str) -> str:    # Redis Stream of one request's Events
        return f"{self.prefix}:events:{request_id}"

    def cancel(self, request_id: str) -> str:    # set by the gateway when the client left
        return f"{self.prefix}:cancel:{request_id}"

    def worker(self, worker_id: str) -> str:     # WorkerInfo (msgpack) with a TTL = heartbeat
        return f"{self.prefix}:worker:{worker_id}"

    def workers_pattern(self) -> str:            # SCAN pattern over live workers
        return f"{self.prefix}:worker:*"


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str                                    # system | user | assistant | tool
    content: str | None = None                   # text parts already joined by the gateway
    name: str | None = None


class GenerateJob(msgspec.Struct, frozen=True, kw_only=True):
    """One completion request. Exactly one of `messages` (chat: the worker applies the
    model's chat template) or `prompt` (raw completion text) is set."""

    request_id: str                              # also the RQ job id
    model: str                                   # served model name (the queue it is on)
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    max_tokens: int | None = None                # None: up to the context limit
    sampling: SamplingParams = SamplingParams()
    stop: list[str] = []
    created: float = 0.0                         # unix seconds, set by the gateway
    events_ttl_s: int = 300                      # the stream expires this long after its last event
    # New fields go below this line, with defaults.


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int


class Started(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="started"):
    """The worker took the job (the gateway now watches this worker's heartbeat)."""

    worker_id: str
    prompt_tokens: int


class Token(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="token"):
    """One engine step: 1..k+1 token ids and the text they completed (may be '' while
    a multi-byte character or a possible stop string is held back)."""

    ids: list[int]
    text: str


class Done(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="done"):
    finish_reason: str                           # stop | length | cancelled
    usage: Usage


class Error(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="error"):
    """The request failed; `status` is the HTTP status the gateway should use if it has
    not started streaming (400 bad input, 503/504 worker trouble, 500 engine bug)."""

    message: str
    type: str = "server_error"                   # OpenAI error type
    code: str | None = None                      # e.g. context_length_exceeded
    param: str | None = None
    status: int = 500


Event = Started | Token | Done | Error


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's heartbeat record (refreshed every heartbeat_s, expiring after ttl_s)."""

    worker_id: str
    model: str                                   # the served model name
    device: str                                  # cpu | cuda:N | hip:N
    n_ctx: int                                   # context length per sequence
    capacity: int = 1                            # concurrent sequences (1 until batching)
    current_request: str | None = None           # request id being served, if any
    started_at: float = 0.0
    pid: int = 0
    host: str = ""
    # New fields go below this line, with defaults.


_event_encoder = msgspec.msgpack.Encoder()
_event_decoder = msgspec.msgpack.Decoder(Event)
_job_decoder = msgspec.msgpack.Decoder(GenerateJob)
_worker_decoder = msgspec.msgpack.Decoder(WorkerInfo)


def encode(obj: msgspec.Struct) -> bytes:
    return _event_encoder.encode(obj)


def decode_event(data: bytes) -> Event:
    return _event_decoder.decode(data)


def decode_job(data: bytes) -> GenerateJob:
    return _job_decoder.decode(data)


def decode_worker(data: bytes) -> WorkerInfo:
    return _worker_decoder.decode(data)
