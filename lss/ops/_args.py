"""Scalar arguments of the ops: read as Python numbers, or refused with a message naming the op
and the argument (instead of float()'s or int()'s own message)."""

from __future__ import annotations

import numbers

import torch


def real_number(value, name: str, op: str) -> float:
    """`value` (a Python or numpy real number, or a one-element tensor) as a float."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"lss.ops.{op}: {name} must be a number, got {value!r} ({type(value).__name__})"
        )
    return float(value)


def whole_number(value, name: str, op: str) -> int:
    """`value` as an int: an integer, or a real number without a fractional part (2.0)."""
    number = real_number(value, name, op)
    if not number.is_integer():
        raise ValueError(f"lss.ops.{op}: {name} must be an integer, got {value!r}")
    return int(number)
