"""Helpers shared by the data modules: argument checks (``ValueError`` naming the bad value) and seeds."""

from __future__ import annotations


def check_int(name: str, value: object, *, min_value: int, allow_none: bool = False) -> None:
    """Require ``value`` to be an int (not a bool) ``>= min_value``, or ``None`` when allowed."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < min_value:
        what = f"an int >= {min_value}" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {what}, got {value!r}")


_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A splitmix64-style hash of ints into a torch seed, stable across runs and platforms."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


def check_counts(num_candidates: int, max_next: int) -> None:
    """``num_candidates >= 1`` and ``1 <= max_next <= num_candidates``."""
    check_int("num_candidates", num_candidates, min_value=1)
    check_int("max_next", max_next, min_value=1)
    if max_next > num_candidates:
        raise ValueError(f"max_next={max_next} exceeds num_candidates={num_candidates}")
