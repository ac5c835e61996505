"""The GRPO update's roofline on the machine at hand: its operations by phase against the rate torch's matrix
products reach at the update's own shapes, and the rate the update achieved.

`update_operations(shape, micro_batches, ...)` lists the matrix products of one actor update (ppo_epochs passes
over its micro-batches) by phase, each with its floating-point operation count: the decoder's forward, its
recomputation in backward (actor.gradient_checkpointing), its backward, the chunked log-prob head's forward and
backward (tlt_cli/training/logprobs.py: the backward recomputes each chunk's logits), and, as elementwise
counts, AdamW with the gradient norm over this rank's ZeRO partition and the gradients' all-reduce. Norms,
activations and softmax are not counted (a few operations a value against a product's thousands).
`measure_product_rates` times each distinct product in the form the update runs it (`x @ W.T` forward,
`g @ W` and `g.T @ x` in backward, attention's two batched products) in each dtype asked for, in CPU seconds
(best of a few samples), so `roofline(...)` can say per phase how long the products alone would take and what
fraction of that rate the update reached in the seconds a profiled update spent in each phase
(tlt_cli/bench/update_profile.py; its wall-clock shares scaled to the update's CPU seconds, so both sides
count CPU time: on a shared machine wall-clock says more about the load than about the code).
`tlt bench update` (tlt_cli/bench/update_worker.py) measures it; `--profile` gives the phases.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from tlt_cli.engine.logprobs import CHUNK_TOKENS
from tlt_cli.training.memory import ModelShape
from tlt_cli.training.policy_batch import PolicyBatch

PHASES = ("forward", "recomputation", "backward", "log-prob head", "optimizer", "all-reduce")
# phases whose work is matrix products (the others are elementwise: the roofline's rate does not bound them)
PRODUCT_PHASES = ("forward", "recomputation", "backward", "log-prob head")
# fused AdamW per parameter: decay 1, first moment 3, second moment 4, bias corrections, square root, epsilon,
# division and the step 5; the gradient norm 2 (square, add) and its clipping 1
OPTIMIZER_OPERATIONS_PER_PARAMETER = 16
FLOAT32_BYTES = 4
# a timed sample of a product runs it this many CPU seconds at least (a tiny model's products take microseconds)
SAMPLE_SECONDS = 0.02
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# how the update runs each product: a linear layer's forward, its two backward products, attention's two
FORMS = ("x @ W.T", "g @ W", "g.T @ x", "Q @ K.T", "P @ V")


@dataclass(frozen=True)
class MicroBatchShape:
    """One micro-batch as the update computes it: rows x tokens (padded), and the tokens the head scores; a packed
    one is a row whose attention runs segment by segment: (queries, keys) of each (packed_forward.py)."""

    rows: int
    tokens: int
    head_tokens: int
    attention_segments: tuple[tuple[int, int], ...] | None = None

    def attention_shapes(self) -> list[tuple[int, int, int]]:
        """(queries, keys, rows) of each attention product: every row's square, or each packed segment's."""
        if self.attention_segments is None:
            return [(self.tokens, self.tokens, self.rows)]
        return [(queries, keys, 1) for queries, keys in self.attention_segments]


@dataclass(frozen=True)
class Product:
    """A matrix product [rows, inner] @ [inner, columns], `batch` of them at once, in `form` (FORMS)."""

    form: str
    rows: int
    inner: int
    columns: int
    batch: int = 1

    @property
    def operations(self) -> int:
        return 2 * self.batch * self.rows * self.inner * self.columns


@dataclass(frozen=True)
class UpdateOperations:
    """One update's products by phase (with how many times each runs) and its elementwise operations."""

    products: dict[str, Counter[Product]]
    elementwise: dict[str, int]
    all_reduce_bytes: int

    def phase_operations(self, phase: str) -> int:
        counted = self.products.get(phase, Counter())
        return sum(product.operations * times for product, times in counted.items()) + self.elementwise.get(phase, 0)

    def distinct_products(self) -> list[Product]:
        return sorted({product for counted in self.products.values() for product in counted}, key=repr)


def micro_batch_shapes(
    parts: list[PolicyBatch], packed_segments: list[list[tuple[int, int]]] | None
) -> list[MicroBatchShape]:
    """The actor's micro-batches (`Actor.micro_batches`) as the update computes them: right-padded rows, or each one
    packed sequence attending by the segments `Actor.packed_segments` gives."""
    if packed_segments is None:
        return [
            MicroBatchShape(part.size, int(part.input_ids.shape[1]), int(part.response_mask[:, 1:].sum()))
            for part in parts
        ]
    return [
        MicroBatchShape(
            1, sum(queries for queries, _ in segments), int(part.response_mask[:, 1:].sum()), tuple(segments)
        )
        for part, segments in zip(parts, packed_segments)
    ]


def update_operations(
    shape: ModelShape,
    parts: list[MicroBatchShape],
    recomputation: bool,
    world_size: int = 1,
    ppo_epochs: int = 1,
    reductions_per_epoch: int = 1,
    chunk_tokens: int = CHUNK_TOKENS,
) -> UpdateOperations:
    """The products and operations of one update of `ppo_epochs` passes over `parts` (module docstring);
    reductions_per_epoch: how often the gradients are all-reduced in a pass (ZeRO 2 reduces each micro-batch's,
    `gradient_reductions`)."""
    products: dict[str, Counter[Product]] = {phase: Counter() for phase in PRODUCT_PHASES}
    for part in parts:
        for _ in range(ppo_epochs):
            forward = decoder_forward(shape, part)
            products["forward"].update(forward)
            if recomputation:
                products["recomputation"].update(forward)
            products["backward"].update(decoder_backward(shape, part))
            products["log-prob head"].update(head_products(shape, part.head_tokens, chunk_tokens))
    partition = shape.parameters // world_size
    reductions = ppo_epochs * reductions_per_epoch
    elementwise = {
        "optimizer": OPTIMIZER_OPERATIONS_PER_PARAMETER * partition * ppo_epochs,
        # a ring all-reduce adds (world - 1) / world of the gradients on each rank
        "all-reduce": shape.parameters * (world_size - 1) // world_size * reductions,
    }
    all_reduce_bytes = shape.parameters * FLOAT32_BYTES * reductions if world_size > 1 else 0
    return UpdateOperations(products, elementwise, all_reduce_bytes)


def gradient_reductions(zero_stage: int, micro_batches: int) -> int:
    """How often a pass all-reduces the gradients: ZeRO 2 reduces each micro-batch's into its partitions, ZeRO 0-1
    the accumulated gradients once at the step."""
    return micro_batches if zero_stage >= 2 else 1


def linear_layers(shape: ModelShape) -> list[tuple[int, int]]:
    """(in, out) features of one decoder layer's linear layers: q, k, v, o, gate, up, down."""
    hidden, query, key_value, intermediate = shape.hidden, shape.query_width, shape.key_value_width, shape.intermediate
    return [
        (hidden, query),
        (hidden, key_value),
        (hidden, key_value),
        (query, hidden),
        (hidden, intermediate),
        (hidden, intermediate),
        (intermediate, hidden),
    ]


def decoder_forward(shape: ModelShape, part: MicroBatchShape) -> Counter[Product]:
    """Every layer: each linear layer's `x @ W.T`, attention's scores and its mix of values (every pair counted:
    the kernels run the masked ones too)."""
    tokens = part.rows * part.tokens
    layer = Counter(Product("x @ W.T", tokens, inputs, outputs) for inputs, outputs in linear_layers(shape))
    head_dim = shape.query_width // shape.attention_heads
    for queries, keys, rows in part.attention_shapes():
        layer[Product("Q @ K.T", queries, head_dim, keys, rows * shape.attention_heads)] += 1
        layer[Product("P @ V", queries, keys, head_dim, rows * shape.attention_heads)] += 1
    return Counter({product: times * shape.layers for product, times in layer.items()})


def decoder_backward(shape: ModelShape, part: MicroBatchShape) -> Counter[Product]:
    """Every layer: each linear layer's gradient of its input (`g @ W`) and of its weight (`g.T @ x`); attention's
    four (dV = P.T @ dO, dP = dO @ V.T, dQ = dS @ K, dK = dS.T @ Q)."""
    tokens = part.rows * part.tokens
    layer: Counter[Product] = Counter()
    for inputs, outputs in linear_layers(shape):
        layer[Product("g @ W", tokens, outputs, inputs)] += 1
        layer[Product("g.T @ x", outputs, tokens, inputs)] += 1
    head_dim = shape.query_width // shape.attention_heads
    for queries, keys, rows in part.attention_shapes():
        layer[Product("Q @ K.T", queries, head_dim, keys, rows * shape.attention_heads)] += 1
        layer[Product("P @ V", queries, keys, head_dim, rows * shape.attention_heads)] += 3
    return Counter({product: times * shape.layers for product, times in layer.items()})


def head_products(shape: ModelShape, head_tokens: int, chunk_tokens: int) -> Counter[Product]:
    """The chunked head over `head_tokens` rows: the logits forward, and in backward the logits again, the
    gradient of the hidden states and of the head's weight."""
    products: Counter[Product] = Counter()
    hidden, vocab = shape.hidden, shape.vocab_size
    for first in range(0, head_tokens, chunk_tokens):
        rows = min(chunk_tokens, head_tokens - first)
        products[Product("x @ W.T", rows, hidden, vocab)] += 2
        products[Product("g @ W", rows, vocab, hidden)] += 1
        products[Product("g.T @ x", vocab, rows, hidden)] += 1
    return products


def measure_product_rates(
    products: list[Product], dtypes: list[str], repeats: int = 3
) -> dict[str, dict[Product, float]]:
    """Seconds of each product in each dtype ("fp32", "bf16"): best of `repeats` after one warm-up, in this
    process's torch threads, in the form the update runs it."""
    return {
        dtype: {product: product_seconds(product, DTYPES[dtype], repeats) for product in products} for dtype in dtypes
    }


@torch.no_grad()
def product_seconds(product: Product, dtype: torch.dtype, repeats: int) -> float:
    """CPU seconds (all the process's threads: on a shared machine a product's wall-clock swings with the load,
    its CPU time much less) of one run of `product`, best of `repeats` samples of at least SAMPLE_SECONDS each."""
    run = product_call(product, dtype)
    started = time.process_time()
    run()
    calls = max(1, math.ceil(SAMPLE_SECONDS / max(time.process_time() - started, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for _ in range(calls):
            run()
        best = min(best, (time.process_time() - started) / calls)
    return best


def product_call(product: Product, dtype: torch.dtype):
    """A function that runs `product` once on random operands of `dtype`, laid out as the update's are."""
    rows, inner, columns, batch = product.rows, product.inner, product.columns, product.batch
    generator = torch.Generator().manual_seed(0)

    def operand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(dtype)

    if product.form == "x @ W.T":  # nn.Linear's forward: the weight is [out, in]
        inputs, weight = operand(rows, inner), operand(columns, inner)
        return lambda: torch.nn.functional.linear(inputs, weight)
    if product.form == "g @ W":  # the gradient of the input: [tokens, out] @ the [out, in] weight
        gradient, weight = operand(rows, inner), operand(inner, columns)
        return lambda: gradient @ weight
    if product.form == "g.T @ x":  # the gradient of the weight: the [tokens, out] gradient transposed @ the inputs
        gradient, inputs = operand(inner, rows), operand(inner, columns)
        return lambda: gradient.T @ inputs
    if product.form == "Q @ K.T":
        queries, keys = operand(batch, rows, inner), operand(batch, columns, inner)
        return lambda: queries @ keys.transpose(-1, -2)
    if product.form == "P @ V":
        weights, values = operand(batch, rows, inner), operand(batch, inner, columns)
        return lambda: weights @ values
    raise ValueError(f"no product form '{product.form}' (one of {', '.join(FORMS)})")


@dataclass(frozen=True)
class PhaseRoofline:
    """One phase: its operations, the seconds the update spent in it, and the seconds its products alone take at
    the rates measured (per dtype; none for elementwise phases)."""

    phase: str
    operations: int
    seconds: float
    bound_seconds: dict[str, float]

    @property
    def achieved_rate(self) -> float:
        """Operations a second the update reached in this phase."""
        return self.operations / self.seconds if self.seconds > 0 else 0.0

    def product_rate(self, dtype: str) -> float | None:
        """Operations a second torch's products reach at this phase's shapes in `dtype`."""
        bound = self.bound_seconds.get(dtype)
        return self.operations / bound if bound else None

    def fraction(self, dtype: str) -> float | None:
        """The achieved rate as a fraction of the products' rate in `dtype`."""
        rate = self.product_rate(dtype)
        return self.achieved_rate / rate if rate else None


@dataclass(frozen=True)
class UpdateRoofline:
    """The update's phases and its whole (update_seconds: wall-clock of the whole update) in one report."""

    phases: list[PhaseRoofline]
    update_seconds: float
    compute_dtype: str
    all_reduce_bytes: int

    @property
    def operations(self) -> int:
        return sum(phase.operations for phase in self.phases)

    @property
    def achieved_rate(self) -> float:
        return self.operations / self.update_seconds if self.update_seconds > 0 else 0.0

    def bound_seconds(self, dtype: str) -> float:
        """The products of every product phase at the rates measured in `dtype` (the head in float32 always)."""
        return sum(phase.bound_seconds[dtype] for phase in self.phases if dtype in phase.bound_seconds)

    def fraction(self) -> float:
        """The update's achieved rate as a fraction of its products' rate in the dtype it ran in."""
        bound = self.bound_seconds(self.compute_dtype)
        return bound / self.update_seconds if self.update_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        phases = [
            {
                **asdict(phase),
                "achieved_rate": phase.achieved_rate,
                "product_rates": {dtype: phase.product_rate(dtype) for dtype in phase.bound_seconds},
                "fraction_of_product_rate": phase.fraction(self.compute_dtype),
            }
            for phase in self.phases
        ]
        return {
            "compute_dtype": self.compute_dtype,
            "operations": self.operations,
            "update_seconds": self.update_seconds,
            "achieved_rate": self.achieved_rate,
            "bound_seconds": {dtype: self.bound_seconds(dtype) for dtype in self.phases[0].bound_seconds},
            "fraction_of_product_rate": self.fraction(),
            "all_reduce_bytes": self.all_reduce_bytes,
            "phases": phases,
        }


def roofline(
    operations: UpdateOperations,
    product_seconds_by_dtype: dict[str, dict[Product, float]],
    phase_seconds: dict[str, float],
    update_seconds: float,
    compute_dtype: str,
) -> UpdateRoofline:
    """The report: per phase its operations, measured seconds and the products' seconds at the measured rates.
    The log-prob head runs in float32 whatever the decoder's dtype (logprobs.py), so its bound is float32's."""
    phases = []
    for phase in PHASES:
        bound: dict[str, float] = {}
        if phase in PRODUCT_PHASES:
            for dtype, seconds in product_seconds_by_dtype.items():
                rates = product_seconds_by_dtype.get("fp32") if phase == "log-prob head" else seconds
                if rates is not None:
                    bound[dtype] = sum(rates[product] * times for product, times in operations.products[phase].items())
        phases.append(PhaseRoofline(phase, operations.phase_operations(phase), phase_seconds.get(phase, 0.0), bound))
    return UpdateRoofline(phases, update_seconds, compute_dtype, operations.all_reduce_bytes)
