"""Paged KV cache block manager: allocate, append, free, prefix caching and host swap space.

Block ids are real rows of the cache tensor in live mode and bookkeeping only in simulation; the
manager does not know which. Allocation answers ``False`` when it cannot allocate and leaves the
request untouched (as vLLM's KV cache manager answers ``None``): the scheduler decides what to
preempt.

Prefix caching keys full prompt blocks by a hash chain: with token ids, each block's key hashes
its parent's key and its own tokens; without them (pure simulation), blocks inside a request's
shared prefix are keyed by ``(prefix_id, block index)``, which names the same chain. Cached blocks
are ref-counted; a block whose last user leaves stays cached and becomes evictable, least
recently used first.

A request preempted by recompute can find its own blocks again (``cache_preempted``), as in
vLLM V1: ``KVCacheManager.allocate_slots`` there publishes every full block, prompt and generated,
as it fills, and ``free`` (called by ``Scheduler._preempt_request``) leaves them cached until
evicted. Here they are published once, just before the victim's blocks are freed, which gives the
same hits: past a shared prefix its blocks are its own, so nobody could have hit them earlier.
Their keys continue the request's chain: a plain request's own blocks get keys of their own,
with token ids the chain runs on over the generated ids when the request has them (live mode) and
over the request id when it does not (simulation), and segments already key the generated tokens.
Live and simulated runs of one workload therefore find the same blocks, unless two requests of a
live run hold the same prompt and generated tokens, where live mode (as vLLM) may find the other's.
When the victim is admitted again ``lookup_prefix`` looks it up to ``num_tokens - 1`` tokens
(vLLM's ``get_computed_blocks``), so only an evicted tail is recomputed.

Eviction follows vLLM's block pool where it can: a request frees its blocks tail first
(``free_blocks(reversed(...))``), so its tail is evicted before its head, and cached blocks are
evicted least recently freed first. One difference: vLLM keeps every free block in one queue in the
order it was freed, hashed or not, while here blocks without a key (never used, or freed unkeyed)
are handed out before any cached block is evicted. A plain request that finishes frees unkeyed
blocks here, where vLLM would have hashed and queued them, so a victim's published blocks can
outlive blocks that vLLM would have evicted after them. Likewise a queued request whose blocks were
found but whose admission then failed gives them back at the recently used end
(``blocks.drop_cached_prefix``), where vLLM's ``allocate_slots`` fails before it touches them. Both
keep a waiting victim's blocks longer than vLLM would: its re-hits here are an upper bound on vLLM's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .prefix_keys import segment_block_keys
from .request import Request, RequestState

_OWN = 0x0_0E1F  # tags the keys of blocks only their own request holds (past any shared prefix)


@dataclass(slots=True)
class KVStats:
    num_blocks: int
    num_free: int
    num_cached_evictable: int
    num_host_blocks: int
    num_host_free: int
    prefix_hits: int  # blocks served from the prefix cache to requests never preempted
    prefix_queries: int  # cacheable blocks those requests looked up
    preempted_prefix_hits: int  # the same for requests coming back from a preemption (vLLM counts them apart)
    preempted_prefix_queries: int


def _take_free(table: list[int], free: list[int], need: int) -> None:
    """Move ``need`` blocks from the end of the free list onto ``table``, in pop order.

    Whole blocks off the free list at once (ref counts matter only with prefix caching).
    """
    if need == 1:
        table.append(free.pop())
    else:
        taken = free[-need:]
        del free[-need:]
        taken.reverse()
        table.extend(taken)


class BlockManager:
    """Owns ``num_blocks`` device blocks of ``block_size`` tokens and ``num_host_blocks`` host blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = False,
        num_host_blocks: int = 0,
        watermark: float = 0.0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        # pop() hands out the lowest id first, which keeps live-mode runs easy to read.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # holders of each keyed block (a key in _block_key); a block no key names has one holder at
        # most and is counted 0, so taking and freeing such blocks is list work, not a count per block
        self._ref = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        # prefix cache
        self._block_key: list[int | None] = [None] * num_blocks
        self._key_block: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._keys: dict[int, list[int]] = {}  # request_id -> keys of its cacheable prompt blocks
        # request_id -> how many of those keys are in the cache; its table's blocks from there on are
        # its own and named by no key
        self._registered: dict[int, int] = {}
        # request_id -> its own blocks were published at a preemption (cache_preempted): True with
        # the generated tokens', False the prompt's only; its lookups reach past the prompt
        self._rehit: dict[int, bool] = {}
        # vLLM's PrefixCacheStats.record: a request's lookups after it was preempted count apart
        self.prefix_hits = 0
        self.prefix_queries = 0
        self.preempted_prefix_hits = 0
        self.preempted_prefix_queries = 0
        # host swap space
        self.num_host_blocks = num_host_blocks
        self._host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._host_tables: dict[int, list[int]] = {}
        # Host blocks freed by a swap-in are reusable only from the next step: this step's copy
        # out of them has not run yet.
        self._host_deferred: list[int] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: never-used free blocks plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_host_free_blocks(self) -> int:
        return len(self._host_free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def num_blocks_of(self, request: Request) -> int:
        table = self._tables.get(request.request_id)
        return len(table) if table is not None else 0

    def block_table(self, request: Request) -> list[int]:
        """The request's device blocks in token order (empty if it holds none)."""
        return self._tables.get(request.request_id, [])

    def holds(self, request: Request) -> bool:
        return request.request_id in self._tables or request.request_id in self._host_tables

    def can_allocate(self, num_blocks: int, *, watermark: bool = False) -> bool:
        """Whether ``num_blocks`` more blocks can be taken, keeping the watermark free if asked."""
        reserve = self.watermark_blocks if watermark else 0
        return self.num_free_blocks - num_blocks >= reserve

    def stats(self) -> KVStats:
        return KVStats(
            self.num_blocks,
            self.num_free_blocks,
            len(self._evictable),
            self.num_host_blocks,
            len(self._host_free),
            self.prefix_hits,
            self.prefix_queries,
            self.preempted_prefix_hits,
            self.preempted_prefix_queries,
        )

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, request: Request, num_tokens: int, *, watermark: bool = False) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens; ``False`` (and no change) if short."""
        table = self._tables.get(request.request_id)
        need = -(-num_tokens // self.block_size) - (len(table) if table is not None else 0)
        if need <= 0:
            return True
        free = self._free
        if not self.can_allocate(need, watermark=watermark):
            return False
        if table is None:
            table = self._tables[request.request_id] = []
        # never-used blocks first, in pop order; then cached ones are evicted, least recently used first
        take = min(need, len(free))
        if take:
            _take_free(table, free, take)
        for _ in range(need - take):
            table.append(self._evict())
        return True

    def extend_each(self, requests: list[Request], counts: list[int]) -> int:
        """``counts[i]`` (>= 1) more blocks for ``requests[i]``, for each i in order, as ``allocate``
        of the tokens they would hold takes them (no watermark). Returns -1 when all succeeded, else
        the index of the first that failed (the ones before it keep their blocks, the ones after it
        are not tried). One call per step instead of one per growing request, for callers that track
        each table's length already."""
        free = self._free
        if sum(counts) > len(free):  # some must be evicted from the prefix cache (or are short)
            bs = self.block_size
            for j, (req, c) in enumerate(zip(requests, counts, strict=True)):
                if not self.allocate(req, (self.num_blocks_of(req) + c) * bs):
                    return j
            return -1
        tables = self._tables
        pop = free.pop
        for req, c in zip(requests, counts, strict=True):
            table = tables.get(req.request_id)
            if table is None:
                table = tables[req.request_id] = []
            if c == 1:  # the common case: a decode crossing into a new block
                table.append(pop())
            else:
                _take_free(table, free, c)
        return -1

    def append_blocks(self, requests: list[Request]) -> bool:
        """One more block for each of ``requests`` (a request may appear more than once), taken in
        that order, as ``allocate`` one block at a time would take them. ``False`` (and no change)
        if the blocks are short."""
        k = len(requests)
        if k > self.num_free_blocks:
            return False
        if k == 0:
            return True
        tables = self._tables
        free = self._free
        if len(free) < k:  # some are evicted from the prefix cache
            take = self._take_block
            for req in requests:
                table = tables.get(req.request_id)
                if table is None:
                    table = tables[req.request_id] = []
                table.append(take())
            return True
        # no sharing: the k blocks pop() would hand out, in pop order
        taken = free[-k:]
        del free[-k:]
        taken.reverse()
        for req, block in zip(requests, taken, strict=True):
            table = tables.get(req.request_id)
            if table is None:
                table = tables[req.request_id] = []
            table.append(block)
        return True

    def _take_block(self) -> int:
        """One block: a never-used one, else the least recently used cached one, evicted."""
        return self._free.pop() if self._free else self._evict()

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)  # least recently used
        del self._key_block[self._block_key[block]]  # type: ignore[index]
        self._block_key[block] = None
        return block

    def free(self, request: Request) -> int:
        """Release every device block the request holds; returns how many it held."""
        if (self.enable_prefix_caching and request.segments is not None
                and request.state == RequestState.FINISHED):
            # vLLM caches every full block, generated tokens included: the next turn of a
            # conversation finds the reply too (KV covers all its tokens but the last sampled one)
            self.cache_computed_blocks(request, request.prompt_len + request.output_len - 1)
        table = self._tables.pop(request.request_id, None)
        self._keys.pop(request.request_id, None)
        registered = self._registered.pop(request.request_id, 0)
        if request.state == RequestState.FINISHED:
            self._rehit.pop(request.request_id, None)
        if not table:
            return 0
        n = len(table)
        free = self._free
        if not self.enable_prefix_caching or registered == 0:
            # nothing keyed (no sharing): every block goes straight back, tail first
            table.reverse()
            free.extend(table)
            return n
        # Free in reverse so the tail of a sequence is evicted before its head (vLLM does the same).
        # Past its registered blocks a table holds only blocks of its own that no key names: they go
        # back to the free list at once; the ones before may be shared or cached.
        if registered < n:
            tail = table[registered:]
            tail.reverse()
            free.extend(tail)
        ref, keyed, evictable = self._ref, self._block_key, self._evictable
        for block in reversed(table[:registered]):
            if keyed[block] is None:
                free.append(block)
                continue
            left = ref[block] - 1
            ref[block] = left
            if left == 0:
                evictable[block] = None
        return n

    # ---- prefix caching --------------------------------------------------------------------
    def _prompt_keys(self, request: Request) -> list[int]:
        keys = self._keys.get(request.request_id)
        if keys is not None:
            return keys
        bs = self.block_size
        keys = []
        if request.segments is not None:
            # prompt and output content: a finished request's output blocks are cached too (free());
            # first, so a live turn whose token ids realise its segments keys them as the simulation does
            keys = segment_block_keys(request.segments, bs, request.prompt_len + request.output_len - 1)
        elif request.prompt_token_ids is not None:
            ids = request.prompt_token_ids
            parent = 0
            for i in range(len(ids) // bs):
                parent = hash((parent, tuple(ids[i * bs : (i + 1) * bs])))
                keys.append(parent)
        elif request.prefix_id >= 0:
            for i in range(min(request.prefix_len, request.prompt_len) // bs):
                keys.append(hash(("prefix", request.prefix_id, i)))
        rehit = self._rehit.get(request.request_id)
        if rehit is not None:
            keys = self._own_keys(request, keys, request.num_tokens - 1 if rehit else request.num_prompt_tokens)
        self._keys[request.request_id] = keys
        self._registered[request.request_id] = 0
        return keys

    def _own_keys(self, request: Request, keys: list[int], num_tokens: int) -> list[int]:
        """``keys`` continued over the request's full blocks among its first ``num_tokens`` tokens,
        prompt and generated (segments already cover both)."""
        bs = self.block_size
        n = num_tokens // bs
        if request.segments is not None or len(keys) >= n:
            return keys
        keys = list(keys)
        rid = request.request_id
        if request.prompt_token_ids is None:
            # past the shared prefix the content is the request's own
            keys.extend(hash((_OWN, rid, i)) for i in range(len(keys), n))
            return keys
        # vLLM's chain over prompt + output ids (Request.block_hashes grows as tokens are appended);
        # a simulated request has no generated ids, and its generated blocks are its own
        ids = request.all_token_ids() if request.output_token_ids else request.prompt_token_ids
        parent = keys[-1] if keys else 0
        for i in range(len(keys), n):
            block = ids[i * bs : (i + 1) * bs]
            parent = hash((parent, tuple(block))) if len(block) == bs else hash((parent, _OWN, rid, i))
            keys.append(parent)
        return keys

    def _lookup_limit(self, request: Request, keys: list[int]) -> int:
        """Blocks a lookup may serve: the request's tokens but one (vLLM's ``max_cache_hit_length =
        num_tokens - 1``), its prompt's unless its own generated blocks were published."""
        tokens = request.num_tokens if request.request_id in self._rehit else request.num_prompt_tokens
        return min(len(keys), (tokens - 1) // self.block_size)

    def lookup_prefix(self, request: Request) -> int:
        """Attach the longest run of cached blocks to a request that holds none.

        Returns the number of tokens now served from the cache: prompt tokens, and for a request
        preempted after ``cache_preempted`` generated ones too. At least one token is always left
        to compute, so the step that catches up can sample.
        """
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return 0
        keys = self._prompt_keys(request)
        limit = self._lookup_limit(request, keys)
        blocks: list[int] = []
        for key in keys[:limit]:
            block = self._key_block.get(key)
            if block is None:
                break
            blocks.append(block)
        # vLLM's PrefixCacheStats.record(preempted=request.num_preemptions > 0): the exported
        # prefix_cache_queries / hits leave out the lookups of requests coming back
        if request.num_preemptions:
            self.preempted_prefix_queries += limit
            self.preempted_prefix_hits += len(blocks)
        else:
            self.prefix_queries += limit
            self.prefix_hits += len(blocks)
        if not blocks:
            return 0
        for block in blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
        self._tables[request.request_id] = blocks
        self._registered[request.request_id] = len(blocks)
        return len(blocks) * self.block_size

    def peek_prefix(self, request: Request) -> int:
        """Tokens a ``lookup_prefix`` would serve from the cache now, without attaching them.

        For policies that rank the queue by cache hits (SGLang's longest-prefix-match); the
        hit/query counters are left alone.
        """
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return 0
        keys = self._prompt_keys(request)
        limit = self._lookup_limit(request, keys)
        hits = 0
        for key in keys[:limit]:
            if key not in self._key_block:
                break
            hits += 1
        return hits * self.block_size

    def prefix_keys(self, request: Request) -> list[int]:
        """The hash-chain keys of the request's full prompt blocks (empty without prefix caching)."""
        return self._prompt_keys(request) if self.enable_prefix_caching else []

    def cache_computed_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's keyed blocks that are now fully computed to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        keys = self._prompt_keys(request)
        done = self._registered.get(request.request_id, 0)
        upto = min(len(keys), num_computed_tokens // self.block_size)
        table = self._tables.get(request.request_id)
        if table is None or upto <= done:
            return
        for i in range(done, upto):
            key = keys[i]
            block = table[i]
            if key in self._key_block or self._block_key[block] is not None:
                continue  # another request published the same content first
            self._key_block[key] = block
            self._block_key[block] = key
            self._ref[block] = 1  # its one holder: the publishing request
        self._registered[request.request_id] = upto

    def cache_preempted(self, request: Request, generated: bool) -> None:
        """Publish a request about to be preempted by recompute: its fully computed blocks, prompt
        and (``generated``) generated ones, so that once freed they stay in the cache until evicted
        and its readmission finds them. Call before ``free``; the request's ``num_computed_tokens``
        must be current (synced from the running table).

        ``generated`` False keeps the prompt's blocks only (SGLang's radix tree holds the prefilled
        prompt, not the decoded tokens).
        """
        if not self.enable_prefix_caching or request.request_id not in self._tables:
            return
        rid = request.request_id
        self._rehit[rid] = generated
        computed = request.num_computed_tokens
        upto = computed if generated else min(computed, request.num_prompt_tokens)
        keys = self._prompt_keys(request)
        self._keys[rid] = self._own_keys(request, keys, upto)
        self.cache_computed_blocks(request, upto)

    # ---- swap ------------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host memory: (device, host) copy pairs, or None if host is full."""
        table = self._tables.get(request.request_id)
        if not table:
            return []
        if len(self._host_free) < len(table):
            return None
        pairs = [(block, self._host_free.pop()) for block in table]
        self._host_tables[request.request_id] = [host for _, host in pairs]
        self.free(request)
        return pairs

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request's blocks back: (host, device) copy pairs, or None if short of blocks."""
        host = self._host_tables.get(request.request_id)
        if host is None:
            return []
        if not self.can_allocate(len(host)):
            return None
        device = [self._take_block() for _ in host]
        self._tables[request.request_id] = device
        del self._host_tables[request.request_id]
        self._host_deferred.extend(reversed(host))
        return list(zip(host, device, strict=True))

    def end_step(self) -> None:
        """The step's block copies are decided: host blocks freed by swap-ins become reusable."""
        if self._host_deferred:
            self._host_free.extend(self._host_deferred)
            self._host_deferred.clear()

    # ---- end-of-run check ------------------------------------------------------------------
    def check_all_free(self) -> None:
        """Raise if any block is still held: every request must have returned its blocks."""
        self.end_step()
        if self._tables or self._host_tables:
            held = sorted(set(self._tables) | set(self._host_tables))[:10]
            raise AssertionError(f"KV blocks leaked: requests {held} still hold blocks")
        refs_clear = not self.enable_prefix_caching or not any(self._ref)
        if self.num_free_blocks != self.num_blocks or not refs_clear:
            raise AssertionError(
                f"KV accounting broken: {self.num_free_blocks} free of {self.num_blocks} with no holder"
            )
        if len(self._host_free) != self.num_host_blocks:
            raise AssertionError("host swap blocks leaked")


_NO_BLOCK = (-1, -1)  # a swap copy pair of CountingBlockManager: it keeps no block ids


class CountingBlockManager(BlockManager):
    """``BlockManager`` without block ids: simulation with prefix caching off.

    There no decision and no output reads which blocks a request holds: ids matter to the prefix
    cache (off) and to live mode's kernels (which read ``block_table``; live mode builds a
    ``BlockManager``). So this keeps how many device and host blocks each request holds and how
    many are free, and answers every call as ``BlockManager(enable_prefix_caching=False)`` does
    (``tests/test_kv_cache.py`` runs both through random operation sequences), without a list per
    request and a list operation per block (6-7 % of a simulated step's instructions,
    ``benchmarks/sim_instructions.py``). A swap's copy pairs are placeholders, one ``(-1, -1)``
    per block moved: a simulated step counts them (its swap bytes) and nothing reads their ids.
    """

    def __init__(self, num_blocks: int, block_size: int, *, num_host_blocks: int = 0, watermark: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching=False, num_host_blocks=num_host_blocks,
                         watermark=watermark)
        # the id lists of the base class stay empty; counts instead
        self._free, self._ref, self._block_key, self._host_free = [], [], [], []
        self._nfree = num_blocks
        self._held: dict[int, int] = {}  # request_id -> device blocks
        self._host_nfree = num_host_blocks
        self._host_held: dict[int, int] = {}  # request_id -> host blocks (swapped out)
        self._host_deferred_n = 0

    @property
    def num_free_blocks(self) -> int:
        return self._nfree

    @property
    def num_host_free_blocks(self) -> int:
        return self._host_nfree

    def num_blocks_of(self, request: Request) -> int:
        return self._held.get(request.request_id, 0)

    def block_table(self, request: Request) -> list[int]:
        raise RuntimeError("CountingBlockManager keeps block counts, not block ids (simulation without prefix "
                           "caching); live mode, which reads block tables, builds a BlockManager")

    def holds(self, request: Request) -> bool:
        return request.request_id in self._held or request.request_id in self._host_held

    def stats(self) -> KVStats:
        return KVStats(self.num_blocks, self._nfree, 0, self.num_host_blocks, self._host_nfree, self.prefix_hits,
                       self.prefix_queries, self.preempted_prefix_hits, self.preempted_prefix_queries)

    def allocate(self, request: Request, num_tokens: int, *, watermark: bool = False) -> bool:
        have = self._held.get(request.request_id, 0)
        need = -(-num_tokens // self.block_size) - have
        if need <= 0:
            return True
        if self._nfree - need < (self.watermark_blocks if watermark else 0):
            return False
        self._held[request.request_id] = have + need
        self._nfree -= need
        return True

    def extend_each(self, requests: list[Request], counts: list[int]) -> int:
        held = self._held
        total = sum(counts)
        if total <= self._nfree:
            for req, c in zip(requests, counts, strict=True):
                rid = req.request_id
                held[rid] = held.get(rid, 0) + c
            self._nfree -= total
            return -1
        for j, (req, c) in enumerate(zip(requests, counts, strict=True)):  # short: up to the first that fails
            if c > self._nfree:
                return j
            rid = req.request_id
            held[rid] = held.get(rid, 0) + c
            self._nfree -= c
        return -1

    def append_blocks(self, requests: list[Request]) -> bool:
        k = len(requests)
        if k > self._nfree:
            return False
        held = self._held
        for req in requests:
            rid = req.request_id
            held[rid] = held.get(rid, 0) + 1
        self._nfree -= k
        return True

    def _take_block(self) -> int:
        raise RuntimeError("CountingBlockManager hands out no block ids")

    def free(self, request: Request) -> int:
        n = self._held.pop(request.request_id, 0)
        self._nfree += n
        return n

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        n = self._held.get(request.request_id, 0)
        if n == 0:
            return []
        if self._host_nfree < n:
            return None
        self._host_held[request.request_id] = n
        self._host_nfree -= n
        self.free(request)
        return [_NO_BLOCK] * n

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        n = self._host_held.get(request.request_id)
        if n is None:
            return []
        if not self.can_allocate(n):
            return None
        self._held[request.request_id] = n
        self._nfree -= n
        del self._host_held[request.request_id]
        self._host_deferred_n += n  # reusable from the next step, as BlockManager's deferred host blocks
        return [_NO_BLOCK] * n

    def end_step(self) -> None:
        if self._host_deferred_n:
            self._host_nfree += self._host_deferred_n
            self._host_deferred_n = 0

    def check_all_free(self) -> None:
        self.end_step()
        if self._held or self._host_held:
            held = sorted(set(self._held) | set(self._host_held))[:10]
            raise AssertionError(f"KV blocks leaked: requests {held} still hold blocks")
        if self._nfree != self.num_blocks:
            raise AssertionError(f"KV accounting broken: {self._nfree} free of {self.num_blocks} with no holder")
        if self._host_nfree != self.num_host_blocks:
            raise AssertionError("host swap blocks leaked")
