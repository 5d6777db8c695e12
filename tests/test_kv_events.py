"""vLLM's KV events on the CPU build, read into a PrefixTracker (issue 43, item 2): the tracker holds exactly the
blocks vLLM's prefix cache holds, named by the hashes the gateway computes from the prompt alone, through a
conversation's turns, while vToken's compactor evicts (compacted blocks are removed from the cache and from the
tracker) and after a lost batch. The engine runs in this process (conftest), so the test reads vLLM's own cache."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm_harness import prompts  # noqa: E402

from actors.prefix_tracker import PrefixTracker  # noqa: E402
from vtoken.models import model_path  # noqa: E402
from vtoken.prefix_hash import prefix_hashes  # noqa: E402
from vtoken.vllm_adapter.kv_events import cached_hashes  # noqa: E402

BS = 32


class Counting(PrefixTracker):
    def __init__(self, *a):
        super().__init__(*a)
        self.removals = 0

    def removed(self, hashes):
        self.removals += len(hashes)
        super().removed(hashes)


def settled(tracker: PrefixTracker, llm, timeout_s: float = 20.0) -> bool:
    """Events travel through vLLM's publisher thread and ours: wait until the tracker agrees with vLLM's cache (a
    bound on waiting, not a measurement)."""
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        if set(tracker.engine) == cached_hashes(llm):
            return True
        time.sleep(0.05)
    return False


def run(vtoken: dict, turns: list[list[int]] | None = None, batch: list[list[int]] | None = None):
    """Turns of one conversation (each turn's prompt: the last prompt, its answer, a new message), or one batch of
    prompts at once; returns (tracker, every full sequence served, settled after each step, subscriber)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vtoken.vllm_adapter import VTokenConfig, open_llm
    from vtoken.vllm_adapter.kv_events import KVEventSubscriber, events_config, remove_endpoint

    args, where = events_config({"dtype": "float32", "block_size": BS, "max_model_len": 1024, "seed": 0,
                                 "kv_cache_memory_bytes": 64 << 20, "skip_tokenizer_init": True})  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)
    sequences, agreed = [], []
    # Subscribed before the engine binds its endpoint: ZeroMQ connects once it does, long before the first request,
    # so no batch is published before the subscription is in place. Capacity: more than the 1,024-block pool.
    tracker = Counting(BS, 2048)
    sub = KVEventSubscriber(*where, tracker)
    try:
        with open_llm(str(model_path("tiny-llama")), VTokenConfig(**vtoken), **args) as llm:
            if batch is not None:
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
                sequences += [p + list(o.outputs[0].token_ids) for p, o in zip(batch, outs)]
                agreed.append(settled(tracker, llm))
            prompt = None
            for msg in turns or ():
                prompt = msg if prompt is None else prompt + msg
                out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
                prompt = prompt + list(out.outputs[0].token_ids)
                sequences.append(prompt)
                agreed.append(settled(tracker, llm))
    finally:
        sub.close()
        remove_endpoint(where[0])
    return tracker, sequences, agreed, sub


def named_by_the_gateway(tracker: PrefixTracker, sequences: list[list[int]]) -> bool:
    """Every hash the tracker holds is one the gateway computes for a prefix of a sequence served."""
    known = {h for s in sequences for h in prefix_hashes(s, BS)}
    return tracker.hashes() <= known


def test_a_conversation_the_tracker_holds_what_vllms_cache_holds_in_the_gateways_hashes():
    """The default configuration (pressure mode: nothing evicted while the pool holds what runs)."""
    turns = prompts(3, lengths=(150, 40, 40))
    tracker, sequences, agreed, sub = run({}, turns=turns)
    assert all(agreed), agreed
    assert named_by_the_gateway(tracker, sequences) and sub.gaps == 0
    # turn 3's prompt (turns 1 and 2, their answers, a message) is read from the cache to its last whole block
    third_prompt = sequences[1] + turns[2]
    whole = prefix_hashes(sequences[1][:-1], BS)  # the last answer token's KV is computed by the next turn
    assert set(whole) <= tracker.hashes() and set(prefix_hashes(third_prompt, BS)[: len(whole)]) == set(whole)
    tracker.check_integrity()


def test_blocks_vtokens_compactor_changes_leave_the_cache_and_the_tracker():
    """Always-evicting h2o: compaction moves tokens between blocks, and each block that lost or gained tokens is
    evicted from vLLM's cache (BlockPool.evict_blocks), which the tracker hears as removals."""
    tracker, sequences, agreed, _ = run({"policy": "h2o", "evict": "always", "budget": 0.5, "sink": 2, "recent": 4},
                                        batch=prompts(3, lengths=(200, 260, 150)))  # fmt: skip
    assert all(agreed), agreed
    assert tracker.removals > 0
    assert named_by_the_gateway(tracker, sequences)
    tracker.check_integrity()


def test_a_lost_batch_clears_the_tracker_rather_than_trust_it():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from vtoken.vllm_adapter.kv_events import KVEventSubscriber

    t = PrefixTracker(4, 16)
    sub = KVEventSubscriber("ipc:///nonexistent-vtoken-test", "kv", t)  # reads nothing; batches applied by hand
    try:
        sub.apply(0, [BlockStored([11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None)])
        assert len(t.hashes()) == 2
        sub.apply(1, [BlockRemoved([12], "GPU")])
        assert len(t.hashes()) == 1 and sub.gaps == 0
        sub.apply(3, [BlockStored([13], None, [9, 9, 9, 9], 4, None, "GPU", None)])  # batch 2 is lost
        assert sub.gaps == 1 and len(t.hashes()) == 1  # cleared, then block 13 stored
        sub.apply(4, [BlockStored([14], None, [8, 8, 8, 8], 4, None, "CPU", None)])  # an offload tier: not the pool
        assert len(t.hashes()) == 1
    finally:
        sub.close()
