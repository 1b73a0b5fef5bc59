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
