"""bfloat16 copies of float32 weights that follow small updates: rounding with fixed random thresholds.

Round-to-nearest does not follow an RL-sized update. A step of 1e-6 is far below half a bfloat16 ulp,
so a weight on the bfloat16 grid stays put while a weight lying halfway between two bfloat16 values
flips a whole ulp in the step's direction: on SmolLM2-135M the round-to-nearest copy moved ~300x more
than the float32 policy it copies (BENCHMARKS.md, "bfloat16 that follows the update").

`stochastic_bfloat16(weight, key)` rounds each element up to the next bfloat16 value (away from zero)
with probability equal to its remainder there, so the copy's expected value is the float32 weight and
its expected change is the weight's change, however small. The random part is a fixed threshold per
element (a table drawn once from a fixed seed, read from an offset that the key sets), not a fresh
draw: the copy is a pure function of the weight's values and its key. So every copy of the same
weights is the same, bit for bit: the rollout engine's decode copy (llama_family.py) and the learner's
compute copy (training/rounded_compute.py) sample and learn with the very same bfloat16 policy, every
rank rounds alike, and a resumed run rounds as the first did. An element whose weight does not move keeps
its copy; one that moves by a fraction f of an ulp moves its copy one ulp with probability about f.

The arithmetic works on the float32 bit pattern: adding a threshold t in [0, 2^16) to the 16 bits a
bfloat16 drops carries into the kept bits exactly when remainder + t >= 2^16, with probability
remainder / 2^16; the dropped bits are then cleared, which leaves a float32 that bfloat16 holds exactly.
"""

from __future__ import annotations

import functools
import zlib

import torch

# elements per threshold table: a prime, so the table's period never lines up with a weight's row width
TABLE_LENGTH = 4_194_301
TABLE_SEED = 20_260_126
DROPPED_BITS = 16  # float32 keeps 23 mantissa bits, bfloat16 7
KEPT_MASK = -(1 << DROPPED_BITS)  # 0xFFFF0000 as a signed int32
CHUNK_ELEMENTS = TABLE_LENGTH  # elements rounded per pass (bounded scratch memory for any weight size)


def parameter_key(name: str) -> int:
    """A stable key for a parameter's name: the offset of its thresholds in the table."""
    return zlib.crc32(name.encode())


def stochastic_bfloat16(weight: torch.Tensor, key: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A bfloat16 copy of float32 `weight` (any shape), rounded with the fixed thresholds at `key`'s offset.

    out: a bfloat16 tensor of weight's shape to write into (else a new one). Non-float32 weights are cast as
    torch casts them (a bfloat16 weight is copied exactly)."""
    source = weight.detach()
    if out is None:
        out = torch.empty(source.shape, dtype=torch.bfloat16, device=source.device)
    if source.dtype != torch.float32:
        return out.copy_(source)
    flat_source, flat_out = source.reshape(-1), out.view(-1)
    thresholds = _threshold_table(source.device)
    offset = key % TABLE_LENGTH
    with torch.no_grad():
        for start in range(0, flat_source.numel(), CHUNK_ELEMENTS):
            end = min(start + CHUNK_ELEMENTS, flat_source.numel())
            window = thresholds[offset : offset + end - start]
            # add a threshold below the dropped bits' range, carry into the kept bits, clear the dropped bits
            bits = flat_source[start:end].view(torch.int32) + window
            bits.bitwise_and_(KEPT_MASK)
            flat_out[start:end].copy_(bits.view(torch.float32))
            not_a_number = torch.isnan(flat_source[start:end])
            if not_a_number.any():  # a NaN's payload may carry into the sign bit (all ones: -0.0): keep it NaN
                flat_out[start:end][not_a_number] = flat_source[start:end][not_a_number].to(torch.bfloat16)
    return out


@functools.cache
def _threshold_table(device: torch.device) -> torch.Tensor:
    """Twice TABLE_LENGTH uniform int32 thresholds in [0, 2^16) on `device` (so any offset reads a whole
    chunk), drawn once per process from TABLE_SEED: the same table on every rank and in every run."""
    generator = torch.Generator().manual_seed(TABLE_SEED)
    table = torch.randint(0, 1 << DROPPED_BITS, (TABLE_LENGTH,), dtype=torch.int32, generator=generator)
    return torch.cat([table, table]).to(device)
