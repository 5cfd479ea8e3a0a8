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
import time

import numpy as np
import torch

from . import attention
from .model import AttentionMetadata, LlamaModel


def _capture_flag(model: LlamaModel, capture: bool | None) -> bool:
    """Whether to record graphs: on request, else when the model is on a CUDA device."""
    capture = model.device.type == "cuda" if capture is None else capture
    if capture and model.device.type != "cuda":
        raise ValueError("CUDA graphs need the model on a CUDA device")
    return capture


def _check_rope(model: LlamaModel, captured_ptr: int, max_context: int) -> None:
    """Captured graphs read the rotary table in place: it must be the one they were captured with."""
    if model.rope_table_ptr() != captured_ptr:
        raise RuntimeError("the model's rotary table was reallocated after the CUDA graphs were captured "
                           f"(a position past max_context {max_context}?)")


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
        self.capture = _capture_flag(model, capture)
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
            _check_rope(self.model, self._rope_ptr, self.max_context)
            self._graphs[size].replay()
            return self._logits[size][:b]
        return self._forward(size)[:b]


def token_capture_sizes(max_tokens: int) -> list[int]:
    """Padded token counts of piecewise graphs up to ``max_tokens``: every 16 to 256, every 64 to
    1,024, every 256 beyond (at most 1/4 of a step padding), and ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = [s for s in (*range(16, 257, 16), *range(320, 1025, 64), *range(1280, max_tokens + 1, 256))
             if s <= max_tokens]
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


class PiecewiseGraphs:
    """Steps that are not plain decodes, with their layers' non-attention work replayed from CUDA
    graphs and attention run eagerly between them (vLLM V1's piecewise graphs).

    Per padded token count (``token_capture_sizes``) a chain of num_layers + 1 graphs: the embedding,
    rotary and layer 0's q/k/v; for each layer its output projection, MLP and the next layer's q/k/v;
    the last layer's and the final norm. Every piece reads and writes static buffers shared by all
    sizes (the residual stream, q, k, v, the attention output), so the graphs hold no activations of
    their own beyond a piece's temporaries. A step pads its tokens to the next size (padding: token 0
    at position 0, written nowhere, attended by nothing); between pieces the step's own attention
    (write_kv, then prefill or paged attention) runs on its real tokens into the static output; the
    LM head runs eagerly on the sampled rows. On a CPU (or with ``capture=False``) the same pieces
    run eagerly over the same buffers. Not yet run on a GPU (README "Live mode").
    """

    def __init__(self, model: LlamaModel, kv_tensor: torch.Tensor, max_tokens: int, max_context: int,
                 capture: bool | None = None) -> None:
        if max_context < 1:
            raise ValueError(f"max_context must be >= 1 token, got {max_context}")
        cfg = model.config
        self.model = model
        self.kv_tensor = kv_tensor
        self.sizes = token_capture_sizes(max_tokens)
        self.max_context = max_context
        self.capture = _capture_flag(model, capture)
        n, dev, dt, d = self.sizes[-1], model.device, model.dtype, cfg.head_dim
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.x = torch.zeros(n, cfg.hidden_size, dtype=dt, device=dev)
        self.q = torch.zeros(n, cfg.num_heads, d, dtype=dt, device=dev)
        self.k = torch.zeros(n, cfg.num_kv_heads, d, dtype=dt, device=dev)
        self.v = torch.zeros(n, cfg.num_kv_heads, d, dtype=dt, device=dev)
        self.o = torch.zeros(n, cfg.num_heads, d, dtype=dt, device=dev)
        self.cos = torch.zeros(n, d // 2, dtype=dt, device=dev)  # the step's rotary angles, from piece 0
        self.sin = torch.zeros(n, d // 2, dtype=dt, device=dev)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._pool = None
        self._rope_ptr = 0
        self.num_replays = 0  # steps run through the pieces

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def covers(self, num_tokens: int, max_seq_len: int) -> bool:
        """A step the pieces run: 1..max_tokens tokens, no sequence past ``max_context``."""
        return 0 < num_tokens <= self.max_tokens and max_seq_len <= self.max_context

    def padded(self, tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, tokens)]

    # -- the pieces (each reads and writes the static buffers' first ``size`` rows) --------------

    def _piece(self, size: int, i: int) -> None:
        """Piece ``i`` of a chain: 0 = embedding + layer 0's q/k/v; 1..L-1 = layer i-1's output and
        MLP + layer i's q/k/v; L = the last layer's output and MLP + the final norm."""
        m, layers = self.model, len(self.model.layers)
        x, cos, sin = self.x[:size], self.cos[:size], self.sin[:size]
        if i == 0:
            c, s = m._rope(self.positions[:size], self.max_context)
            cos.copy_(c)
            sin.copy_(s)
            x.copy_(torch.nn.functional.embedding(self.input_ids[:size], m.embed))
        else:
            x.copy_(m.post_attention(i - 1, x, self.o[:size]))
        if i == layers:
            x.copy_(m.final_norm(x))
            return
        q, k, v = m.pre_attention(i, x, cos, sin)
        self.q[:size].copy_(q)
        self.k[:size].copy_(k)
        self.v[:size].copy_(v)

    def capture_all(self) -> float:
        """Record every size's chain (largest first, one memory pool for their temporaries), each
        piece after an eager run of it; returns the seconds it took. A no-op without capture."""
        if not self.capture or self._graphs:
            return 0.0
        t0 = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        layers = len(self.model.layers)
        with torch.inference_mode():
            for size in reversed(self.sizes):
                chain = []
                for i in range(layers + 1):
                    self._piece(size, i)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool):
                        self._piece(size, i)
                    chain.append(graph)
                self._graphs[size] = chain
        torch.cuda.synchronize()
        self._rope_ptr = self.model.rope_table_ptr()
        return time.perf_counter() - t0

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """fp32 logits [sampling rows, vocab] of one step: ``ModelRunner``'s device inputs (ids and
        positions of its real tokens, in order; ``md.slot_mapping`` of the same tokens)."""
        t = input_ids.shape[0]
        size = self.padded(t)
        m = self.model
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.input_ids[t:size].zero_()  # padding: token 0 at position 0
        self.positions[t:size].zero_()
        if self.capture:
            _check_rope(m, self._rope_ptr, self.max_context)
        chain = self._graphs.get(size) if self.capture else None
        q, k, v, o = self.q[:t], self.k[:t], self.v[:t], self.o[:t]
        with torch.inference_mode():
            for i in range(len(m.layers) + 1):
                if chain is not None:
                    chain[i].replay()
                else:
                    self._piece(size, i)
                if i == len(m.layers):
                    break
                k_cache, v_cache = self.kv_tensor[i, 0], self.kv_tensor[i, 1]
                attention.write_kv(k, v, k_cache, v_cache, md.slot_mapping, backend=m.backend)
                if md.prefill_only:
                    attention.prefill_attention(q, k, v, md.query_start_loc, md.max_query_len, scale=m.scale,
                                                backend=m.backend, out=o)
                else:
                    attention.paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                              md.max_query_len, scale=m.scale, backend=m.backend, out=o)
            hidden = self.x[:t]
            if md.logits_indices is not None:
                hidden = hidden[md.logits_indices]
            self.num_replays += 1
            return m._logits(hidden)
