"""One simulated replica: vLLM v1's scheduler in miniature over a pool of blocks, steps timed by the model.

Each step (``plan``), as ``vllm/v1/core/sched/scheduler.py`` Scheduler.schedule does:
  1. running requests first, in admission order: a prefill chunk (at most ``prefill_chunk`` tokens, at most
     the step's token budget) or one decode token; the blocks the request holds during that forward come
     from its ``BlockProfile`` (what vToken or Naive-Evict really held at that context in the engine's trace).
     A request that cannot get its blocks preempts the last running one (recompute: it waits again, at the
     front, and starts over), itself if it is the last;
  2. then waiting requests in arrival order, while the first chunk's blocks fit and there is token budget and
     a sequence slot (first come, first served: the head that does not fit blocks the rest). With a prefix cache
     (``prefix_cache.py``), an admitted request's prefill starts after its cached leading blocks.
The step lasts ``StepTime.seconds`` of what it scheduled; its tokens take effect when it ends.

A **decode run** stands for many identical steps at once (the simulator's only shortcut, exact for what it
covers): when nothing waits and every running request decodes, the next ``k`` steps schedule the same
requests and only grow blocks, so they are simulated as one event up to the first completion or the first
step whose blocks would not fit; their attention reads a few more live tokens each step, so they are all
timed at the run's middle (exact when the step model has no live-token term). An arrival or cancellation
ends the run at the end of the step in progress (``interrupt``), as the real scheduler would see it at its
next ``schedule``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cluster.sim.calibration import BlockProfile, StepTime
from cluster.sim.prefix_cache import PrefixCache
from cluster.sim.workload import Request
from vtoken.core.budget import live_tokens


class Seq:
    """A request on a replica. ``ctx`` after a forward: prompt tokens read, or prompt + outputs when decoding
    (a decode forward writes the previous output's KV); ``held``: blocks it holds now."""

    __slots__ = ("req", "profile", "read", "out", "held", "cancelled", "admitted", "first_token_at", "hit")

    def __init__(self, req: Request, profile: BlockProfile):
        self.req, self.profile = req, profile
        self.read = self.out = self.held = self.hit = 0  # hit: prompt tokens read from the prefix cache
        self.cancelled = self.admitted = False
        self.first_token_at: float | None = None


@dataclass(frozen=True)
class Limits:
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    prefill_chunk: int | None = None
    budget: float | None = 0.5  # the policy's budget (None: no eviction): what a decode's attention reads
    protected: int = 20  # sink + recent tokens, never evicted

    def live(self, ctx: int) -> int:
        """Live tokens of a request at ``ctx`` tokens: the compactor's rule (vtoken/core/budget.py)."""
        return live_tokens(ctx, self.budget, self.protected, 0)


class Replica:
    """Invariant (``check_integrity``): ``used`` is the sum of ``held`` over running requests and never
    exceeds ``pool``; a waiting request holds nothing."""

    def __init__(self, name: str, pool: int, limits: Limits, steps: StepTime, prefix_cache: bool = False):
        self.name, self.pool, self.lim, self.st = name, pool, limits, steps
        self.cache = PrefixCache(pool) if prefix_cache else None
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.used = 0
        self.preemptions = 0
        # The work in flight: one step (its forwards) or a decode run (t0, step seconds, k steps).
        self.step: list[tuple[Seq, int, bool, int]] | None = None
        self.run: tuple[float, float, int] | None = None
        self.ends_at: float | None = None
        self.admitted_now: list[Seq] = []

    @property
    def free(self) -> int:
        return self.pool - self.used

    @property
    def busy(self) -> bool:
        return self.ends_at is not None

    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.busy

    def check_integrity(self) -> None:
        if self.used != sum(s.held for s in self.running) or not 0 <= self.used <= self.pool:
            raise AssertionError(f"{self.name}: used {self.used} of {self.pool}, running hold {self.held_sum()}")
        if any(s.held for s in self.waiting):
            raise AssertionError(f"{self.name}: a waiting request holds blocks")
        if self.cache is not None:
            self.cache.check_integrity()

    def held_sum(self) -> int:
        return sum(s.held for s in self.running)

    # ------------------------------------------------------------------ planning
    def plan(self, now: float) -> float | None:
        """Schedule the next step (or decode run) at ``now``; returns when it ends (None: nothing to do)."""
        self.admitted_now = []
        run = self._decode_run()
        if run is not None:
            k, d = run
            self.run, self.ends_at = (now, d, k), now + k * d
            return self.ends_at
        sched: list[tuple[Seq, int, bool, int]] = []
        budget, bs = self.lim.max_num_batched_tokens, self.lim.block_size
        cap = self.lim.prefill_chunk or budget
        i = 0
        while i < len(self.running) and budget > 0:
            s = self.running[i]
            prefill = s.read < s.req.prompt
            new = min(s.req.prompt - s.read, cap, budget) if prefill else 1
            need = s.profile.blocks(s.read + new if prefill else s.req.prompt + s.out, prefill, bs)
            while need - s.held > self.free and self.running[-1] is not s:
                self._preempt(self.running[-1])
            if need - s.held > self.free:  # it was the last: it preempts itself
                self._preempt(s)
                break
            self.used += need - s.held
            s.held = need
            sched.append((s, new, prefill, need))
            budget -= new
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.lim.max_num_seqs:
            s = self.waiting[0]
            start = self._cached(s)
            new = min(s.req.prompt - start, cap, budget)
            need = s.profile.blocks(start + new, True, bs)
            if need > self.free:
                break
            self.waiting.popleft()
            self.running.append(s)
            if start:
                self.cache.touch(s.req.prefix[: start // bs])
            s.read = s.hit = start
            s.admitted, s.held = True, need
            self.used += need
            self.admitted_now.append(s)
            sched.append((s, new, True, need))
            budget -= new
        if not sched:
            return None
        decodes = sum(1 for x in sched if not x[2])
        pre_tokens = sum(x[1] for x in sched if x[2])
        kv = sum(self.lim.live(s.req.prompt + s.out) for s, _, prefill, _ in sched if not prefill)
        self.step = sched
        self.ends_at = now + self.st.seconds(decodes, pre_tokens, len(sched) - decodes, kv)
        return self.ends_at

    def _cached(self, s: Seq) -> int:
        """Prompt tokens a request admitted now reads from the prefix cache: its leading cached blocks, short of its
        last token (vLLM computes at least one: Scheduler's max_cache_hit_length = num_tokens - 1)."""
        if self.cache is None or not s.req.prefix:
            return 0
        return min(self.cache.match(s.req.prefix), (s.req.prompt - 1) // self.lim.block_size) * self.lim.block_size

    def _preempt(self, s: Seq) -> None:
        self.running.remove(s)
        self.used -= s.held
        s.held = s.read = s.out = 0
        self.waiting.appendleft(s)
        self.preemptions += 1

    def _decode_run(self) -> tuple[int, float] | None:
        if self.waiting or not self.running or any(s.read < s.req.prompt or s.cancelled for s in self.running):
            return None
        k = min(s.req.output - s.out for s in self.running)
        if k < 2 or self._run_need(1) - self.used > self.free:
            return None
        if self._run_need(k) > self.pool:  # the largest j whose blocks fit (blocks only grow while decoding)
            lo, hi = 1, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self._run_need(mid) <= self.pool else (lo, mid - 1)
            k = lo
        # Live tokens grow by about budget x k over the run: its steps are timed at the run's middle.
        kv = sum(self.lim.live(s.req.prompt + s.out + k // 2) for s in self.running)
        return k, self.st.seconds(len(self.running), 0, 0, kv)

    def _run_need(self, j: int) -> int:
        bs = self.lim.block_size
        return sum(s.profile.blocks(s.req.prompt + s.out + j - 1, False, bs) for s in self.running)

    # ------------------------------------------------------------------ time passing
    def interrupt(self, now: float) -> float | None:
        """Something changed (an arrival, a cancellation): a decode run stops at the end of the step in progress.
        Returns the new end time if it moved."""
        if self.run is None:
            return None
        t0, d, k = self.run
        j = min(k, int((now - t0) / d) + 1)
        if j >= k:
            return None
        self.run, self.ends_at = (t0, d, j), t0 + j * d
        return self.ends_at

    def sync(self, now: float) -> None:
        """Commit the steps of a decode run that ended by ``now`` (a report mid-run sees them)."""
        if self.run is None:
            return
        t0, d, k = self.run
        j = min(k - 1, int((now - t0) / d))
        if j > 0:
            self._apply_decodes(j)
            self.run = (t0 + j * d, d, k - j)

    def finish_step(self, now: float) -> list[Seq]:
        """The step or run in flight ends at ``now``: tokens take effect. Returns the requests that ended
        (completed or cancelled), their blocks freed."""
        if self.run is not None:
            self._apply_decodes(self.run[2])
        else:
            for s, new, prefill, _ in self.step or ():
                if s.cancelled:
                    continue
                if prefill:
                    s.read += new
                    if s.read == s.req.prompt:  # the last chunk's forward samples the first token
                        s.out, s.first_token_at = 1, now
                        if self.cache is not None:
                            self.cache.store(s.req.prefix)
                else:
                    s.out += 1
        self.step = self.run = self.ends_at = None
        ended = [s for s in self.running if s.cancelled or s.out >= s.req.output]
        for s in ended:
            self.running.remove(s)
            self.used -= s.held
            s.held = 0
            if self.cache is not None and not s.cancelled and s.req.then is not None:
                # its answer's whole blocks too (the last sampled token's KV is never computed): the next turn's
                # prompt starts with them
                self.cache.store(s.req.then.prefix[: (s.req.prompt + s.req.output - 1) // self.lim.block_size])
        return ended

    def _apply_decodes(self, j: int) -> None:
        bs = self.lim.block_size
        for s in self.running:
            s.out += j
            held = s.profile.blocks(s.req.prompt + s.out - 1, False, bs)
            self.used += held - s.held
            s.held = held

    def cancel(self, s: Seq) -> bool:
        """The client gave up. A waiting request leaves at once; a running one when its step ends.
        Returns whether it was waiting."""
        s.cancelled = True
        if s in self.waiting:
            self.waiting.remove(s)
            return True
        return False
