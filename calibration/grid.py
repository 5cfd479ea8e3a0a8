"""The batch shapes a calibration sweep times: prefill-only, decode-only and mixed steps.

A shape is one engine step: per row, ``q`` new tokens over ``ctx`` tokens already cached (the
same two arrays the cost model reads). The grid spans what a scheduler with the given budgets
can produce — ``max_num_seqs`` rows, ``max_tokens`` new tokens per step, contexts up to
``max_context`` — on a geometric ladder of lengths, plus seeded random shapes in between so the
fit sees rows of unequal length (real decode batches never have one context length).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Shape:
    regime: str  # "prefill", "decode" or "mixed" (cost_model.classify_step of q)
    q: tuple[int, ...]
    ctx: tuple[int, ...]

    @property
    def key(self) -> str:
        """A stable id: ``q=...;ctx=...`` (also how the raw CSV stores the shape)."""
        return f"q={' '.join(map(str, self.q))};ctx={' '.join(map(str, self.ctx))}"

    @property
    def num_tokens(self) -> int:
        return sum(self.q)

    @property
    def max_seq_len(self) -> int:
        return max(c + q for q, c in zip(self.q, self.ctx, strict=True))


@dataclass(frozen=True, slots=True)
class GridSpec:
    max_num_seqs: int = 32
    max_tokens: int = 512  # new tokens per step (max_num_batched_tokens)
    max_context: int = 512  # tokens already cached, per row
    quick: bool = False
    seed: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _ladder(lo: int, hi: int, quick: bool) -> list[int]:
    """16, 24, 32, 48, 64, ... up to hi (quick: powers of two only), always ending at hi."""
    out, x = [], lo
    while x < hi:
        out.append(x)
        if not quick:
            mid = x * 3 // 2
            if mid < hi:
                out.append(mid)
        x *= 2
    return [*out, hi]


def _decode_ctx(rng: np.random.Generator, rows: int, longest: int) -> list[int]:
    """Contexts of ``rows`` decodes, the longest exactly ``longest``, the others below it."""
    ctx = rng.integers(max(1, longest // 4), longest + 1, rows).tolist()
    ctx[0] = longest
    return ctx


def build_grid(spec: GridSpec) -> list[Shape]:
    """Every shape of the sweep, deduplicated, in a deterministic order."""
    rng = np.random.default_rng(spec.seed)
    lens = _ladder(16, spec.max_tokens, spec.quick)
    ctxs = _ladder(16, spec.max_context, spec.quick)
    seqs = [b for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
            if b < spec.max_num_seqs] + [spec.max_num_seqs]
    if spec.quick:
        seqs = seqs[::2] + ([seqs[-1]] if len(seqs) % 2 == 0 else [])
    shapes: list[Shape] = []

    # Prefill-only: one whole prompt of each length; several prompts of random lengths sharing the budget.
    shapes += [Shape("prefill", (n,), (0,)) for n in lens]
    per_count = 1 if spec.quick else 3
    for b in (2, 3, 4, 6, 8, 12, 16):
        if b > spec.max_num_seqs or 16 * b > spec.max_tokens:
            continue
        for _ in range(per_count):
            q = rng.integers(16, spec.max_tokens // b + 1, b).tolist()
            shapes.append(Shape("prefill", tuple(q), (0,) * b))
    # Chunked continuation: a prompt chunk over cached tokens of its own (paged attention).
    for n in lens[::2] if spec.quick else lens:
        for c in ctxs[::2] if spec.quick else ctxs[::2] + [ctxs[-1]]:
            shapes.append(Shape("prefill", (n,), (c,)))

    # Decode-only: every batch size against every longest context.
    for b in seqs:
        for c in ctxs:
            shapes.append(Shape("decode", (1,) * b, tuple(_decode_ctx(rng, b, c))))

    # Mixed: one prefill chunk (fresh or continuing) beside a decode batch.
    chunk_lens = [n for n in lens if n <= spec.max_tokens - 1]
    candidates = [(n, c0, b, c) for n in chunk_lens for c0 in (0, ctxs[len(ctxs) // 2], ctxs[-1])
                  for b in seqs if b < spec.max_num_seqs and n + b <= spec.max_tokens for c in ctxs[1::2]]
    take = min(len(candidates), 30 if spec.quick else 110)
    for i in sorted(rng.choice(len(candidates), take, replace=False).tolist()):
        n, c0, b, c = candidates[i]
        shapes.append(Shape("mixed", (n, *(1,) * b), (c0, *_decode_ctx(rng, b, c))))
    return list(dict.fromkeys(shapes))
