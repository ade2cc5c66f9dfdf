"""`SamplingParams`: how one request samples and stops, with vLLM's names, defaults and ranges.

Validation here is independent of the model (`__post_init__`); `validate_for_model` adds the
checks that need the vocabulary. Every failure is an `InvalidParameterError` naming the field.
Integer fields are bounded (`MAX_COUNT`, `MAX_SEED`, `MAX_LOGPROBS`), so each fits the int32 or
int64 it is packed into on the wire and in the sampler's tensors.
Sequences (`stop`, `stop_token_ids`) and `logit_bias` are normalised to tuples so the object
stays hashable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kvmesh.engine.errors import InvalidParameterError

SAMPLING_EPS = 1e-5  # temperature below this samples greedily (vLLM's threshold)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_SEED = 2**63
MAX_COUNT = 2**31 - 1  # largest n, top_k, max_tokens, min_tokens: the wire's int32 fields
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping options of one request (vLLM-compatible names and defaults).

    temperature 0 is greedy; top_k 0 or -1 and top_p 1.0 and min_p 0.0 are off; max_tokens None
    generates until the model's maximum length; logprobs N returns the top-N raw-model logprobs
    of every generated position (0: only the sampled token's); seed makes the request's draws
    reproducible regardless of what else is batched with it. detokenize False returns token ids
    only (no text; stop strings then need it True), as vLLM's option of the same name.
    logit_bias maps token ids to values in [-100, 100] added to their logits before penalties
    and sampling (OpenAI's and vLLM's field; logprobs stay those of the raw model); given as a
    mapping or (id, bias) pairs, kept as pairs sorted by id. prompt_logprobs N returns, for
    every prompt token after the first, its raw-model logprob given the tokens before it, its
    rank and the top-N there (vLLM's field; such a prompt is computed whole, not read from the
    prefix cache).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] | str = ()
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] = ()
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            self._set(name, _float(name, getattr(self, name)))
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            self._set(name, _float(name, getattr(self, name)))
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(name, f"expected a bool, got {getattr(self, name)!r}")
        self._check_counts()
        self._check_sampling()
        self._check_penalties()
        self._set("stop", _stop_strings(self.stop))
        if self.stop and not self.detokenize:
            raise InvalidParameterError("detokenize", "stop strings need detokenize=True")
        self._set("stop_token_ids", _stop_token_ids(self.stop_token_ids))
        self._set("logit_bias", _logit_bias(self.logit_bias))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_counts(self) -> None:
        _bounded("n", self.n, 1)
        if self.max_tokens is not None:
            _bounded("max_tokens", self.max_tokens, 1)
        _bounded("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                "min_tokens",
                f"must not exceed max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= _int(name, value) <= MAX_LOGPROBS:
                raise InvalidParameterError(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.seed is not None and not 0 <= _int("seed", self.seed) < MAX_SEED:
            raise InvalidParameterError("seed", f"must be in [0, 2**63), got {self.seed}")

    def _check_sampling(self) -> None:
        if self.temperature < 0.0:
            raise InvalidParameterError(
                "temperature", f"must be non-negative, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not -1 <= _int("top_k", self.top_k) <= MAX_COUNT:
            raise InvalidParameterError(
                "top_k",
                f"must be -1 or 0 (off) or a positive int up to {MAX_COUNT}, got {self.top_k}",
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameterError("min_p", f"must be in [0, 1], got {self.min_p}")

    def _check_penalties(self) -> None:
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidParameterError(
                "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidParameterError(name, f"must be in [-2, 2], got {value}")

    @property
    def greedy(self) -> bool:
        """True when the request always takes the most likely token (temperature ~ 0)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition, presence or frequency penalties is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs sorted by id (its normalised form)."""
        return cast(tuple[tuple[int, float], ...], self.logit_bias)

    def validate_for_model(self, vocab_size: int) -> None:
        """Check the fields that depend on the model: stop_token_ids and logit_bias's token ids
        must lie in the vocabulary."""
        for token_id, _ in self.logit_bias_pairs:
            if token_id >= vocab_size:
                raise InvalidParameterError(
                    "logit_bias", f"token id {token_id} is outside the vocabulary ({vocab_size})"
                )
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise InvalidParameterError(
                    "stop_token_ids",
                    f"token id {token_id} is outside the vocabulary ({vocab_size})",
                )


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(name, f"expected an int, got {value!r}")
    return value


def _bounded(name: str, value: object, low: int) -> None:
    """InvalidParameterError naming `name` unless `value` is an int in [low, MAX_COUNT]."""
    if not low <= _int(name, value) <= MAX_COUNT:
        bound = "at least 1" if low == 1 else "non-negative"
        raise InvalidParameterError(name, f"must be {bound} and at most {MAX_COUNT}, got {value}")


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(name, f"expected a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        raise InvalidParameterError(name, "must be finite, got a larger int") from None
    if not math.isfinite(number):
        raise InvalidParameterError(name, f"must be finite, got {value}")
    return number


def _stop_strings(stop: object) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)):
        raise InvalidParameterError("stop", f"expected a string or a list of strings, got {stop!r}")
    if len(strings) > MAX_STOP_STRINGS:
        raise InvalidParameterError(
            "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}"
        )
    for s in strings:
        if not isinstance(s, str):
            raise InvalidParameterError("stop", f"expected strings, got {s!r}")
        if not s:
            raise InvalidParameterError("stop", "stop strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidParameterError(
                "stop", f"stop strings are at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}"
            )
    return tuple(strings)


def _stop_token_ids(ids: object) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple)):
        raise InvalidParameterError("stop_token_ids", f"expected a list of ints, got {ids!r}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidParameterError(
            "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
        )
    for token_id in ids:
        if _int("stop_token_ids", token_id) < 0:
            raise InvalidParameterError("stop_token_ids", f"must be non-negative, got {token_id}")
    return tuple(ids)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs sorted by id from a mapping or pairs; ids non-negative and
    distinct, biases finite in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], at most
    MAX_LOGIT_BIAS_TOKENS entries."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else bias
    if not isinstance(pairs, Sequence) or isinstance(pairs, str):
        raise InvalidParameterError(
            "logit_bias", f"expected a mapping of ids to floats, got {bias!r}"
        )
    if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidParameterError(
            "logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(pairs)}"
        )
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise InvalidParameterError(
                "logit_bias", f"expected (token id, bias) pairs, got {pair!r}"
            )
        token_id, value = _int("logit_bias", pair[0]), _float("logit_bias", pair[1])
        if token_id < 0 or token_id in out:
            raise InvalidParameterError(
                "logit_bias", f"token id {token_id} is negative or repeated"
            )
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidParameterError(
                "logit_bias", f"bias of token {token_id} must be in [-100, 100], got {value}"
            )
        out[token_id] = value
    return tuple(sorted(out.items()))
