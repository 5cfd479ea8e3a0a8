"""The paged KV cache tensors and the model runner that executes a scheduler's Batch on them.

``KVCache`` holds every layer's K and V blocks in one device tensor plus a host tensor of swap
blocks. ``ModelRunner.execute`` turns a ``Batch`` (rows of new tokens over cached context) and the
block tables of its requests into the packed tensors of one forward pass (vLLM's input
preparation, vectorised with numpy), applies the step's swaps, runs the model and returns the
greedy next token of every sampling row. It never mutates the requests: the live executor does.
With ``use_decode_graphs`` its decode-only steps replay CUDA graphs instead, and with
``use_piecewise_graphs`` the other steps run their layers' non-attention work from graphs (``graphs.py``).
"""

from __future__ import annotations

import time
from itertools import chain

import numpy as np
import torch
from servesim.sim.batch import Batch
from servesim.sim.presets import ModelConfig
from servesim.sim.request import Request

from .graphs import DecodeGraphs, PiecewiseGraphs
from .model import AttentionMetadata, LlamaModel


def _dtype_bytes(dtype: torch.dtype | int) -> int:
    return dtype if isinstance(dtype, int) else torch.empty(0, dtype=dtype).element_size()


class KVCache:
    """Paged K/V for all layers: ``tensor`` [L, 2, num_blocks, block_size, Hkv, D] on ``device``,
    ``host`` [L, 2, num_host_blocks, block_size, Hkv, D] in (pinned, when there is a GPU) host memory.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", num_host_blocks: int = 0) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        shape = (config.num_layers, 2)
        block = (block_size, config.num_kv_heads, config.head_dim)
        # Zeros, not empty: a kernel bug that reads an unwritten slot then shows as wrong numbers, never NaN.
        self.tensor = torch.zeros(*shape, num_blocks, *block, dtype=dtype, device=device)
        pin = torch.cuda.is_available() and self.tensor.is_cuda
        self.host = torch.zeros(*shape, num_host_blocks, *block, dtype=dtype, pin_memory=pin)
        self.bytes_per_block = self.block_bytes(config, block_size, dtype)

    @staticmethod
    def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype | int) -> int:
        """Bytes of one block: ``block_size`` tokens of K and V in every layer."""
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * _dtype_bytes(dtype)

    @staticmethod
    def blocks_for_budget(config: ModelConfig, block_size: int, budget_bytes: float,
                          dtype: torch.dtype | int) -> int:
        """How many whole blocks fit in ``budget_bytes`` (dtype: a torch dtype or bytes per value)."""
        return max(0, int(budget_bytes // KVCache.block_bytes(config, block_size, dtype)))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer ``i``, each [num_blocks, block_size, Hkv, D] (views)."""
        return self.tensor[i, 0], self.tensor[i, 1]

    def copy_blocks_out(self, pairs: list[tuple[int, int]]) -> None:
        """Swap out: copy each (device block, host block) pair to host memory."""
        if pairs:
            dev, host = (torch.tensor(x, dtype=torch.long) for x in zip(*pairs, strict=True))
            self.host[:, :, host] = self.tensor[:, :, dev.to(self.tensor.device)].to("cpu")

    def copy_blocks_in(self, pairs: list[tuple[int, int]]) -> None:
        """Swap in: copy each (host block, device block) pair back to the device."""
        if pairs:
            host, dev = (torch.tensor(x, dtype=torch.long) for x in zip(*pairs, strict=True))
            dev = dev.to(self.tensor.device)
            self.tensor[:, :, dev] = self.host[:, :, host].to(self.tensor.device, non_blocking=True)


def _token_slice(request: Request, start: int, stop: int) -> list[int]:
    """Token ids [start, stop) of prompt + outputs, without concatenating the whole sequence."""
    prompt = request.prompt_token_ids
    if prompt is None:
        raise ValueError(f"request {request.request_id} has no prompt_token_ids; live mode needs token ids")
    p = len(prompt)
    if stop > p + len(request.output_token_ids):
        raise ValueError(f"request {request.request_id}: batch asks for tokens up to {stop} but it has only "
                         f"{p + len(request.output_token_ids)}")
    if stop <= p:
        return prompt[start:stop]
    if start >= p:
        return request.output_token_ids[start - p:stop - p]
    return list(prompt[start:]) + request.output_token_ids[:stop - p]


class ModelRunner:
    """Runs Batches of a scheduler on ``model`` over ``kv_cache`` (blocks of ``block_size`` tokens)."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, block_size: int) -> None:
        if kv_cache.block_size != block_size:
            raise ValueError(f"block_size {block_size} differs from the cache's {kv_cache.block_size}")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device
        self.graphs: DecodeGraphs | None = None  # decode-only steps replayed from CUDA graphs (use_decode_graphs)
        self.piecewise: PiecewiseGraphs | None = None  # other steps' non-attention work (use_piecewise_graphs)
        self.graphed = False  # the last step ran one of the two graph paths

    def use_decode_graphs(self, max_batch: int, max_context: int, capture: bool | None = None) -> DecodeGraphs:
        """Run decode-only steps of up to ``max_batch`` rows and ``max_context`` tokens through
        ``DecodeGraphs`` (captured now on a GPU; the same padded path, eager, on a CPU)."""
        self.graphs = DecodeGraphs(self.model, self.kv_cache.tensor, self.block_size, max_batch, max_context,
                                   capture=capture)
        self.graphs.capture_all()
        return self.graphs

    def use_piecewise_graphs(self, max_tokens: int, max_context: int, capture: bool | None = None) -> PiecewiseGraphs:
        """Run the steps ``use_decode_graphs`` does not take (prefill, mixed) through
        ``PiecewiseGraphs`` up to ``max_tokens`` tokens (captured now on a GPU; eager on a CPU)."""
        self.piecewise = PiecewiseGraphs(self.model, self.kv_cache.tensor, max_tokens, max_context, capture=capture)
        self.piecewise.capture_all()
        return self.piecewise

    def host_arrays(self, batch: Batch, block_tables: list[list[int]]) -> dict[str, np.ndarray]:
        """The packed layout of ``batch`` as host arrays (block_tables in row order): input_ids and
        positions [T], slots [T], the padded block table [B, max blocks], seq_lens [B],
        query_start_loc [B + 1], num_new_tokens / num_context_tokens [B] and samples [B]."""
        n = np.asarray(batch.num_new_tokens, dtype=np.int64)
        ctx = np.asarray(batch.num_context_tokens, dtype=np.int64)
        b, bs = len(n), self.block_size
        if len(block_tables) != b:
            raise ValueError(f"{len(block_tables)} block tables for a batch of {b} rows")
        seq_lens = ctx + n
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        total = int(qsl[-1])

        ids = np.fromiter(chain.from_iterable(_token_slice(r, int(c), int(c + k))
                                              for r, c, k in zip(batch.requests, ctx, n, strict=True)),
                          dtype=np.int64, count=total)
        vocab = self.model.config.vocab_size
        if total and not 0 <= ids.min() <= ids.max() < vocab:
            # Caught here: on a GPU an out-of-range embedding index is an unrecoverable device assert.
            raise ValueError(f"token ids must be in [0, {vocab}) for model {self.model.config.name}, got "
                             f"[{ids.min()}, {ids.max()}]; generate the workload with vocab_size <= {vocab}")
        row = np.repeat(np.arange(b), n)
        positions = np.arange(total) - qsl[:-1][row] + ctx[row]

        # Padded table; padding points at block 0, which no kernel reads past a sequence's length.
        table_lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=b)
        need = np.where(n > 0, -(-seq_lens // bs), 0)  # idle rows (no new tokens) read no blocks
        if np.any(table_lens < need):
            i = int(np.argmax(table_lens < need))
            raise ValueError(f"request {batch.requests[i].request_id}: {table_lens[i]} blocks cannot hold "
                             f"{seq_lens[i]} tokens at block_size {bs}")
        table = np.zeros((b, max(int(table_lens.max(initial=0)), 1)), dtype=np.int64)
        table[np.arange(table.shape[1]) < table_lens[:, None]] = np.fromiter(
            chain.from_iterable(block_tables), dtype=np.int64, count=int(table_lens.sum()))
        slots = table[row, positions // bs] * bs + positions % bs
        return {"input_ids": ids, "positions": positions, "slots": slots, "table": table, "seq_lens": seq_lens,
                "query_start_loc": qsl, "num_new_tokens": n, "num_context_tokens": ctx,
                "samples": np.asarray(batch.samples, dtype=bool)}

    def prepare(self, batch: Batch, block_tables: list[list[int]]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Packed (input_ids [T], positions [T], metadata) of ``batch``; block_tables in row order."""
        return self._device_inputs(self.host_arrays(batch, block_tables))

    def _device_inputs(self, a: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device

        def put(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(x).to(device=dev, dtype=dtype)

        n, qsl = a["num_new_tokens"], a["query_start_loc"]
        md = AttentionMetadata(
            slot_mapping=put(a["slots"], torch.int64),
            block_tables=put(a["table"], torch.int32),
            seq_lens=put(a["seq_lens"], torch.int32),
            query_start_loc=put(qsl, torch.int32),
            max_query_len=int(n.max(initial=0)),
            max_seq_len=int(a["seq_lens"].max(initial=0)),
            prefill_only=not a["num_context_tokens"].any(),
            logits_indices=put(qsl[1:][a["samples"]] - 1, torch.int64),
        )
        return put(a["input_ids"], torch.int64), put(a["positions"], torch.int64), md

    def compute_logits(self, batch: Batch, block_tables: list[list[int]]) -> torch.Tensor:
        """Apply the step's swaps (out, then in), run it; fp32 logits [sampling rows, vocab]."""
        self.kv_cache.copy_blocks_out(batch.swap_out)
        self.kv_cache.copy_blocks_in(batch.swap_in)
        self.graphed = False
        if batch.size == 0 or batch.num_tokens == 0:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        a = self.host_arrays(batch, block_tables)
        if self.graphs is not None and self.graphs.covers(a["num_new_tokens"], a["num_context_tokens"], a["samples"]):
            self.graphed = True
            return self.graphs.logits(a["input_ids"], a["positions"], a["slots"], a["table"], a["seq_lens"])
        input_ids, positions, md = self._device_inputs(a)
        if self.piecewise is not None and self.piecewise.covers(len(a["input_ids"]), md.max_seq_len):
            self.graphed = True
            return self.piecewise.logits(input_ids, positions, md)
        return self.model.forward(input_ids, positions, md, self.kv_cache.tensor)

    def execute(self, batch: Batch, block_tables: list[list[int]]) -> list[int]:
        """Run one engine step; the greedy next token id of each sampling row, in row order."""
        return self.execute_timed(batch, block_tables)[0]

    def execute_timed(self, batch: Batch, block_tables: list[list[int]]) -> tuple[list[int], float]:
        """``execute``, and the ``time.perf_counter()`` at which the host had prepared the inputs and
        launched the whole forward, before waiting for its result: on a GPU the step is host-bound
        when that moment comes close to the step's end (on a CPU the forward runs as it is launched,
        so it is the end of the forward). A step that swaps blocks includes those copies, which the
        host waits for."""
        logits = self.compute_logits(batch, block_tables)
        launched = time.perf_counter()
        return logits.argmax(dim=-1).tolist(), launched
