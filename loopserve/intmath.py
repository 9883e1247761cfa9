"""Integer arithmetic every layer shares (block counts, tiles, grid sizes)."""


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for b > 0, exact at any size (no float rounding)."""
    return -(-a // b)
