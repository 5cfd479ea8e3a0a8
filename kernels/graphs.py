"""Decode steps replayed from CUDA graphs, one per padded batch size (what vLLM does by default).

An eager step of an 8B model launches ~1,100 kernels, and below ~1.5k tokens a step the host's
launching takes longer than the GPU's work (README "H200"). A decode-only step has a fixed shape
per batch size, so ``DecodeGraphs`` records the whole forward once per *capture size* (1, 2, 4,
then every multiple of 8 up to the engine's ``max_num_seqs``, vLLM's list) over static input
buffers, and a step pads its batch to the next capture size, copies its inputs into the buffers
and replays. Padding rows read one cached token of block 0 and write nothing (slot -1); their
logits are dropped. The block table is as wide as the longest sequence the cache can hold, so the
decode kernel's KV split count is fixed per size (``attention._decode_splits``).

On a CPU (or with ``capture=False``) the very same padded path runs eagerly: the tests check it
against ``ModelRunner``'s unpadded forward, leaving only the capture itself to a GPU.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from .model import AttentionMetadata, LlamaModel


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's CUDA-graph batch sizes up to ``max_batch``: 1, 2, 4, 8, 16, 24, ... and ``max_batch``
    itself when it is not on the list."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4) if s <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Decode-only steps of ``model`` over ``kv_tensor`` at every capture size up to ``max_batch``.

    ``max_context``: the longest sequence (tokens) any step may hold; sets the block-table width.
    ``capture``: record CUDA graphs (default: when the model is on a CUDA device).
    """

    def __init__(self, model: LlamaModel, kv_tensor: torch.Tensor, block_size: int, max_batch: int,
                 max_context: int, capture: bool | None = None) -> None:
        if max_context < 1:
            raise ValueError(f"max_context must be >= 1 token, got {max_context}")
        self.model = model
        self.kv_tensor = kv_tensor
        self.block_size = block_size
        self.sizes = capture_sizes(max_batch)
        self.width = -(-max_context // block_size)  # block-table columns
        self.capture = model.device.type == "cuda" if capture is None else capture
        if self.capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        n, dev = self.sizes[-1], model.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.width, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # each graph's output buffer [size, vocab]
        self.num_replays = 0
        self._rope_ptr = 0  # the rotary table the graphs read (it must never be reallocated after capture)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @property
    def max_context(self) -> int:
        return self.width * self.block_size

    def padded(self, rows: int) -> int:
        """The capture size a batch of ``rows`` decode rows runs at."""
        return self.sizes[bisect.bisect_left(self.sizes, rows)]

    def covers(self, num_new_tokens: np.ndarray, num_context_tokens: np.ndarray, samples: np.ndarray) -> bool:
        """A step the graphs run: 1..max_batch rows, each one new token over cached context, each
        sampled, none longer than ``max_context``."""
        b = len(num_new_tokens)
        return (0 < b <= self.max_batch and bool(np.all(num_new_tokens == 1)) and bool(np.all(num_context_tokens > 0))
                and bool(np.all(samples)) and int(num_context_tokens.max()) < self.max_context)

    def _forward(self, size: int) -> torch.Tensor:
        md = AttentionMetadata(
            slot_mapping=self.slots[:size], block_tables=self.block_tables[:size], seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[:size + 1], max_query_len=1, max_seq_len=self.max_context,
            prefill_only=False, logits_indices=None)
        return self.model.forward(self.input_ids[:size], self.positions[:size], md, self.kv_tensor)

    def capture_all(self) -> float:
        """Record every size's graph (largest first), each after an eager run of it that compiles
        its kernels and sizes the rotary table; returns the seconds it took. A no-op without capture."""
        if not self.capture or self._graphs:
            return 0.0
        import time

        t0 = time.perf_counter()
        self._reset_inputs(self.max_batch)
        for size in reversed(self.sizes):
            self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._logits[size] = self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize()
        self._rope_ptr = self.model.rope_table_ptr()
        return time.perf_counter() - t0

    def _reset_inputs(self, size: int) -> None:
        """Padding everywhere in the first ``size`` rows: token 0 at position 0, one cached token
        read from block 0, nothing written."""
        self.input_ids[:size] = 0
        self.positions[:size] = 0
        self.slots[:size] = -1
        self.seq_lens[:size] = 1
        self.block_tables[:size] = 0

    def logits(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, table: np.ndarray,
               seq_lens: np.ndarray) -> torch.Tensor:
        """fp32 logits [rows, vocab] of one decode step (``ModelRunner``'s host arrays, row order).

        The rows past ``len(input_ids)`` up to the capture size are padding; only the first
        ``table.shape[1]`` block-table columns are written (later ones are never read: a row reads
        the blocks its ``seq_lens`` covers)."""
        b = len(input_ids)
        size = self.padded(b)
        pad = size - b
        dev = self.model.device

        def put(dst: torch.Tensor, x: np.ndarray, fill: int) -> None:
            if pad:
                x = np.concatenate([x, np.full((pad, *x.shape[1:]), fill, dtype=x.dtype)])
            dst.copy_(torch.from_numpy(x).to(dev, dst.dtype))

        put(self.input_ids[:size], input_ids, 0)
        put(self.positions[:size], positions, 0)
        put(self.slots[:size], slots, -1)
        put(self.seq_lens[:size], seq_lens, 1)
        # A table wider than the graphs' (blocks held past max_context) is cut: covers() keeps every
        # row's tokens within max_context, so the columns cut are never read.
        w = min(table.shape[1], self.width)
        put(self.block_tables[:size, :w], table[:, :w], 0)
        self.num_replays += 1
        if self.capture:
            if self.model.rope_table_ptr() != self._rope_ptr:
                raise RuntimeError("the model's rotary table was reallocated after the CUDA graphs were captured "
                                   f"(a position past max_context {self.max_context}?)")
            self._graphs[size].replay()
            return self._logits[size][:b]
        return self._forward(size)[:b]
