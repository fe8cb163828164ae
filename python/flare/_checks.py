"""Argument checks that belong to the Python API (types, FlashAttention options flare lacks). Shapes,
dtypes and values are checked by flare's C++ validation, whose Status becomes a ValueError,
TypeError or NotImplementedError naming the argument."""

import torch


def tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(x).__name__}")
    return x


def optional_tensor(name, x):
    return None if x is None else tensor(name, x)


def integer(name, x):
    if type(x) is int:  # the common case first (bool is a subclass of int, not int)
        return x
    if isinstance(x, bool) or not isinstance(x, int):
        if isinstance(x, torch.SymInt):
            return x
        raise TypeError(f"argument '{name}': expected an int, got {type(x).__name__}")
    return x


def number(name, x):
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"argument '{name}': expected a float, got {type(x).__name__}")
    return float(x)


def softmax_scale(x):
    """None means 1/sqrt(head_dim), which flare spells 0."""
    return 0.0 if x is None else number("softmax_scale", x)


def window(window_size):
    """FlashAttention's (left, right) window; -1 means unbounded on that side."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"argument 'window_size': expected a pair (left, right) of ints (-1: unbounded), "
                        f"got {window_size!r}")
    left, right = window_size
    return integer("window_size", left), integer("window_size", right)


def unsupported(name, value, default, what):
    changed = value is not None if default is None else value != default
    if changed:
        raise NotImplementedError(f"argument '{name}': {what}; pass {default!r}")
