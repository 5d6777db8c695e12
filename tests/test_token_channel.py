"""The token channel (actors/token_channel.py): chunks from replica to gateway over ZeroMQ, in order, whole;
a call that ends or fails; a replica that cannot reach the channel; and the served cluster using it."""

from __future__ import annotations

import asyncio

import pytest
from cluster_harness import config, ensure_ray, generate, stub, tokens

from actors.token_channel import ChannelStream, TokenChannel, TokenSender, Unreachable, decode, encode, is_loopback
from actors.wire import Chunk, Seq

pytestmark = pytest.mark.timeout(120)

LPS = (((6, -0.5, 1, " b"), (9, float("-inf"), 2, " z")),) * 2  # per position: (token, logprob, rank, text)
CHUNKS = [
    Chunk((Seq(0, " a", (5,)),)),
    Chunk((Seq(0, " b c", (6, 7), LPS, -1.0), Seq(1, " d", (8,), LPS[:1], -0.5, "stop", 2)), num_cached_tokens=32),
    Chunk((Seq(0, "", (), finish_reason="stop"),), True, prompt_logprobs=(None, LPS[0])),
    Chunk.failed("internal", "replica r1 failed to serve the request"),
]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_a_chunk_crosses_whole(chunk):
    rid, payload = encode("req-1", chunk)
    got = decode(payload)
    assert rid == b"req-1" and got == chunk
    assert all(type(s) is Seq and type(s.token_ids) is tuple for s in got.seqs)


def test_loopback_addresses():
    assert is_loopback("tcp://127.0.0.1:5000") and is_loopback("tcp://localhost:1") and is_loopback("tcp://[::1]:2")
    assert not is_loopback("tcp://10.1.2.3:5000")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _get(inbox):
    await inbox.wait()
    return inbox.chunks.popleft()


def test_chunks_arrive_in_order_and_by_request():
    async def main():
        channel, sender = TokenChannel(), TokenSender()
        a, b = channel.open("a"), channel.open("b")
        for i in range(50):
            await sender.send(channel.address, "a" if i % 2 else "b", Chunk((Seq(0, str(i), (i,)),)))
        await sender.send(channel.address, "nobody", Chunk((Seq(0, "lost"),)))  # dropped: no queue
        got_a = [(await _get(a)).seqs[0].text for _ in range(25)]
        got_b = [(await _get(b)).seqs[0].text for _ in range(25)]
        sender.close()
        await channel.aclose()
        return got_a, got_b

    got_a, got_b = run(main())
    assert got_a == [str(i) for i in range(1, 50, 2)] and got_b == [str(i) for i in range(0, 50, 2)]


def _stream(channel, sender, sent, delay=0.0, error=None):
    """A ChannelStream whose call sends ``sent`` chunks and then returns their count (or raises ``error``)."""

    async def call(address, rid):
        for i in range(sent):
            await sender.send(address, rid, Chunk((Seq(0, str(i), (i,)),), i == sent - 1))
        await asyncio.sleep(delay)
        if error is not None:
            raise error
        return sent

    return ChannelStream(channel, "r", lambda address: call(address, "r"))


async def _all(stream):
    out = []
    while (c := await stream.next()) is not None:
        out.append(c.seqs[0].text)
    stream.close()
    return out


def test_a_stream_ends_with_what_its_call_sent():
    async def main():
        channel, sender = TokenChannel(), TokenSender()
        got = [await _all(_stream(channel, sender, n)) for n in (0, 1, 7)]
        with pytest.raises(ConnectionError):
            await _all(_stream(channel, sender, 3, error=ConnectionError("the replica died")))
        sender.close()
        await channel.aclose()
        return got

    assert run(main()) == [[], ["0"], [str(i) for i in range(7)]]


def test_a_burst_is_read_whole_and_what_is_here_is_taken_without_waiting():
    """More frames than one reader callback takes (TokenChannel.DRAIN) all arrive, in order; ``ready()`` hands
    over what is already here and stops before a failed chunk, which ``next()`` then returns."""

    async def main():
        channel, sender = TokenChannel(), TokenSender()
        burst = channel.DRAIN * 2 + 7

        async def call(address):
            for i in range(burst):
                await sender.send(address, "r", Chunk((Seq(0, str(i), (i,)),)))
            await sender.send(address, "r", Chunk.failed("internal", "boom"))
            return burst + 1

        stream = ChannelStream(channel, "r", call)
        first = await stream.next()
        await stream.call
        while len(stream.inbox.chunks) < burst:  # the rest of the burst, read by the channel's callbacks
            await asyncio.sleep(0.01)
        here = []
        while (c := stream.ready()) is not None:
            here.append(c)
        last = await stream.next()
        end = await stream.next()
        stream.close()
        sender.close()
        await channel.aclose()
        return first, here, last, end

    first, here, last, end = run(main())
    assert [c.seqs[0].text for c in (first, *here)] == [str(i) for i in range(TokenChannel.DRAIN * 2 + 7)]
    assert last.error == "boom" and end is None


def test_a_replica_that_cannot_reach_the_channel_says_so():
    async def main():
        channel = TokenChannel()

        async def call(address):
            return -1

        stream = ChannelStream(channel, "r", call)
        with pytest.raises(Unreachable):
            await stream.next()
        stream.close()
        await channel.aclose()

    run(main())


# ---------------------------------------------------------------------------------------------- served


def test_the_served_cluster_streams_through_the_channel_and_falls_back_to_ray():
    """On one node every replica's chunks come through the channel; a replica that reports itself on another
    node than the gateway's loopback address gets Ray streams instead, and the request still completes."""
    from cluster.server import BackgroundServer

    ensure_ray()
    with BackgroundServer(config("fake-channel", replicas=1)) as s:
        d = s.gateway.dispatcher
        out = generate(stub(s.port), max_tokens=5)
        assert tokens(out) == [" t0", " t1", " t2", " t3", " t4"] and out[-1].finished
        assert d.channel.address.startswith("tcp://127.0.0.1:") and not d._remote
        d._node = "192.0.2.1"  # as if the gateway ran on another node (TEST-NET address)
        out = generate(stub(s.port), max_tokens=5)
        assert tokens(out) == [" t0", " t1", " t2", " t3", " t4"] and out[-1].finished
        assert len(d._remote) == 1


def test_ray_streams_when_configured():
    from cluster.server import BackgroundServer

    ensure_ray()
    with BackgroundServer(config("fake-raystream", replicas=1, gateway={"token_channel": "ray"})) as s:
        assert s.gateway.dispatcher.channel is None
        out = generate(stub(s.port), max_tokens=3)
        assert tokens(out) == [" t0", " t1", " t2"] and out[-1].finished


def test_the_dispatcher_merges_what_is_already_here():
    """A gateway that fell behind sends one merged delta for a request's waiting chunks (dispatch.coalesce), as
    vLLM's AsyncLLM does; it stops at the finished chunk, and never merges a failed one."""
    from cluster.dispatch import coalesce

    class Here:
        def __init__(self, chunks):
            self.chunks = list(chunks)

        def ready(self):
            c = self.chunks[0] if self.chunks else None
            return None if c is None or c.error else self.chunks.pop(0)

    t = [Chunk((Seq(0, f" t{i}", (i,)),)) for i in range(4)]
    end = Chunk((Seq(0, " t4", (4,), finish_reason="length"),), True)
    here = Here([t[1], t[2], Chunk.failed("internal", "boom"), t[3]])
    got = coalesce(t[0], here)
    assert got.seqs[0].text == " t0 t1 t2" and got.seqs[0].token_ids == (0, 1, 2) and len(here.chunks) == 2
    here = Here([t[2], end, t[3]])
    got = coalesce(t[1], here)
    assert got.finished and got.seqs[0].text == " t1 t2 t4" and got.seqs[0].finish_reason == "length"
    assert here.chunks == [t[3]]
    assert coalesce(end, Here([t[0]])) is end
    # n = 2: sequence 0 stops first, sequence 1 runs on: the chunk where 0 stops ends the merge, so the last
    # sequence to finish still names the request's finish in the metrics
    two = [Chunk((Seq(0, " a", (1,)), Seq(1, " b", (2,)))), Chunk((Seq(0, "", (), finish_reason="stop"),
           Seq(1, " c", (3,)))), Chunk((Seq(1, " d", (4,), finish_reason="length"),), True)]  # fmt: skip
    here = Here(two[1:])
    got = coalesce(two[0], here)
    assert got.finish_reason == "stop" and here.chunks == [two[2]]
    assert coalesce(here.chunks.pop(0), here).finish_reason == "length"
