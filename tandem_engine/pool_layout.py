"""How a block of the paged KV pool is stored: lane-folded, one layout on every platform.

A layer buffer of the pool (paged.py) is [KV, num_blocks, B / f, hd * f], f = `lane_fold(hd, B)`:
for a head_dim dividing 128 (64, 32, ...) and a block size f divides, f = 128 / hd positions
share one 128-lane row (row t of a block holds its positions t * f + c, c < f, in lanes
[c * hd, (c + 1) * hd)); otherwise f = 1, [KV, num_blocks, B, hd] as before (head_dim 128 and
256: nothing changes). Row-major, the folded block is the same bytes as [B, hd]: on a CPU `fold`
and `unfold` are reshapes (bitcasts, no copy), so the gather path and the CPU kernel read the
folded pool as [.., B, hd] where it lies.

Why: the TPU compiler lays an array whose minor dimension is under 128 lanes out with another axis
minor (no lanes padded). A [KV, blocks, 16, 64] pool got its block axis minor, which a Pallas
kernel (it reads operands row-major) could not read in place: each call would have copied the
layer's pool (1.88 GB of temporaries for a 0.54 GB pool, compiled for v5e), so head_dim 64 took
the gather path on a TPU; and the layout padded the block axis to a multiple of 128 (the built-in
model's pool took 1.5x its bytes). Folded, [KV, blocks, 8, 128] is laid out row-major (tiles of
8 x 128), the kernel (pallas_decode.py) reads it in place and it takes its own bytes.

Not folded (f = 1), so on a TPU still the gather path: a head_dim that does not divide 128 and is
not a multiple of it (96, 80: a [.., B, 96] pool keeps the TPU's own layout), and a block size
f does not divide (a head_dim of 64 with an odd block size).
"""
from __future__ import annotations

LANES = 128  # a TPU vector register's lanes: the minor dimension a TPU array is laid out in


def lane_fold(head_dim: int, block_size: int) -> int:
    """Positions a 128-lane row of a pool block holds: 128 / head_dim where head_dim divides 128
    (and is under it) and block_size is a multiple of that, else 1."""
    hd, bs = int(head_dim), int(block_size)
    if hd >= LANES or LANES % hd:
        return 1
    f = LANES // hd
    return f if bs % f == 0 else 1


def block_shape(block_size: int, head_dim: int) -> tuple[int, int]:
    """One KV head's block as the pool stores it: (rows, lanes) = (B / f, hd * f)."""
    f = lane_fold(head_dim, block_size)
    return block_size // f, head_dim * f


def block_positions(layer, head_dim: int) -> int:
    """Positions a block of `layer` (a pool layer buffer [KV, num_blocks, rows, lanes]) holds."""
    return layer.shape[-2] * layer.shape[-1] // int(head_dim)


def fold(x, head_dim: int):
    """[..., B, hd] -> the stored block [..., B / f, hd * f] (a reshape: the same bytes)."""
    rows, lanes = block_shape(x.shape[-2], head_dim)
    return x.reshape(*x.shape[:-2], rows, lanes)


def unfold(x, head_dim: int):
    """A stored block [..., rows, lanes] -> [..., B, hd], one position a row (a reshape)."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1] // int(head_dim), int(head_dim))
