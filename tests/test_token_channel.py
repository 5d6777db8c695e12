"""The token channel (actors/token_channel.py): chunks from replica to gateway over ZeroMQ, in order, whole;
a call that ends or fails; a replica that cannot reach the channel; only the replicas' CURVE key gets frames in;
a malformed frame is one warning line; and the served cluster using it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle

import msgpack
import pytest
import zmq
from cluster_harness import config, ensure_ray, generate, stub, tokens
from zmq.utils.monitor import recv_monitor_message

from actors.token_channel import (
    ChannelAddress,
    ChannelStream,
    DropLog,
    Inbox,
    TokenChannel,
    TokenSender,
    Unreachable,
    decode,
    encode,
    is_loopback,
)
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
        inbox = stream.inbox
        while len(inbox.chunks) + inbox.merged < burst:  # the rest of the burst, read by the channel's callbacks
            await asyncio.sleep(0.01)
        assert len(inbox.chunks) <= Inbox.MAX_QUEUED + 1  # nobody read meanwhile: merged, not queued
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
    burst = range(TokenChannel.DRAIN * 2 + 7)
    assert "".join(c.seqs[0].text for c in (first, *here)) == "".join(map(str, burst))
    assert [t for c in (first, *here) for t in c.seqs[0].token_ids] == list(burst)
    assert last.error == "boom" and end is None


@pytest.mark.parametrize("bound", [Inbox.MAX_QUEUED, 10**6])
def test_an_inbox_nobody_reads_holds_a_bounded_number_of_chunks_and_loses_nothing(bound, monkeypatch):
    """Issue 57: a request whose client fell behind merges its waiting deltas (as AsyncLLM's output collector does)
    instead of queueing one object per token; a finishing or failed chunk stays apart, in order. Negative control:
    an inbox with no bound holds every chunk, which the first assertion catches."""
    monkeypatch.setattr(Inbox, "MAX_QUEUED", bound)
    inbox = Inbox()
    for i in range(1000):
        inbox.put(Chunk((Seq(0, str(i), (i,)), Seq(1, "x", (7,)))))
        if i == 500:
            inbox.put(Chunk((Seq(1, "", (), finish_reason="stop"),)))  # sequence 1 finishes: kept apart
    inbox.put(Chunk.failed("internal", "boom"))
    held = list(inbox.chunks)
    if bound == 10**6:
        assert len(held) == 1002 and inbox.merged == 0
        return
    assert len(held) <= Inbox.MAX_QUEUED + 1 and inbox.merged == 1002 - len(held)
    assert [t for c in held for s in c.seqs if s.index == 0 for t in s.token_ids] == list(range(1000))
    finishes = [i for i, c in enumerate(held) if c.finish_reason]
    assert len(finishes) == 1 and held[-1].error == "boom"
    before = held[: finishes[0]]
    assert sum(len(s.token_ids) for c in before for s in c.seqs if s.index == 0) == 501  # chunks 0..500 came first


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


# ---------------------------------------------------------------------------------------------- who may push


def test_an_address_crosses_ray_and_never_shows_its_keys():
    server, (public, secret) = zmq.curve_keypair()[0], zmq.curve_keypair()
    a = ChannelAddress("tcp://127.0.0.1:1", server, public, secret)
    assert pickle.loads(pickle.dumps(a)) == a
    assert str(a) == "tcp://127.0.0.1:1" and str(Unreachable(a.endpoint)) == "tcp://127.0.0.1:1"
    assert not any(k.decode() in repr(a) or k.decode() in str(a) for k in (server, public, secret))


def _peer_keys(address: ChannelAddress, peer: str) -> dict[str, bytes]:
    if peer == "null":  # ZeroMQ's default mechanism: no key at all
        return {}
    if peer == "own key":  # CURVE, and even the server's public key, with a client keypair of its own
        public, secret = zmq.curve_keypair()
        return {"curve_serverkey": address.server_key, "curve_publickey": public, "curve_secretkey": secret}
    return {"curve_serverkey": address.server_key, "curve_publickey": address.client_public,
            "curve_secretkey": address.client_secret}  # fmt: skip


HANDSHAKE = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "failed",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed",
}


def _handshake(monitor: zmq.Socket) -> str:
    """The first handshake outcome the peer's monitor reports (after its connection events)."""
    while monitor.poll(10_000):
        event = recv_monitor_message(monitor)["event"]
        if event in HANDSHAKE:
            return HANDSHAKE[event]
    return "none"


@pytest.mark.parametrize("peer", ["null", "own key", "handed-out keys"])
def test_only_the_handed_out_client_key_gets_frames_in(peer):
    """A foreign PUSH peer on the channel's endpoint, without CURVE or with a keypair of its own, fails the
    handshake and none of its frames reaches the inbox, while the replica's sender's do. Negative control: the
    same peer given the handed-out client keys completes the handshake and delivers (so the test can fail)."""

    async def main():
        channel, sender = TokenChannel(), TokenSender()
        inbox = channel.open("r")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        for option, value in _peer_keys(channel.address, peer).items():
            setattr(sock, option, value)
        monitor = sock.get_monitor_socket()
        sock.connect(channel.address.endpoint)
        for i in range(5):  # queued on the peer's side until (unless) its handshake succeeds
            sock.send_multipart(encode("r", Chunk((Seq(0, f"peer {i}"),))), zmq.NOBLOCK)
        handshake = await asyncio.to_thread(_handshake, monitor)
        for i in range(5):
            await sender.send(channel.address, "r", Chunk((Seq(0, f"replica {i}"),)))
        got = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.0  # after the replica's five, a second more for the peer's
        while len(got) < 10 and (len(got) < 5 or loop.time() < deadline):
            with contextlib.suppress(TimeoutError):
                got.append((await asyncio.wait_for(_get(inbox), 0.1)).seqs[0].text)
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()
        sender.close()
        await channel.aclose()
        return handshake, got

    handshake, got = run(main())
    replica = [t for t in got if t.startswith("replica")]
    foreign = [t for t in got if t.startswith("peer")]
    assert replica == [f"replica {i}" for i in range(5)]
    if peer == "handed-out keys":
        assert handshake == "succeeded" and foreign == [f"peer {i}" for i in range(5)]
    else:
        assert handshake == "failed" and foreign == []


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "vtoken.token_channel" and r.levelno >= logging.WARNING]


def test_a_malformed_frame_is_one_warning_line_and_the_channel_goes_on(caplog):
    """Frames from an admitted peer with the wrong number of parts, or a payload that is not msgpack or not a
    chunk: dropped, one warning line with no traceback for the lot (they come within a second), and the next chunk
    still arrives."""

    async def main():
        channel, sender = TokenChannel(), TokenSender()
        inbox = channel.open("r")
        await sender.send(channel.address, "r", Chunk((Seq(0, "before"),)))
        before = await _get(inbox)
        sock = sender._socket(channel.address)  # the replica's own, admitted, socket
        for frames in ([b"r"], [b"r", b"\xc1 not msgpack"], [b"r", b"a", b"b"], [b"r", msgpack.packb(7)]):
            await sock.send_multipart(frames)
        await sender.send(channel.address, "r", Chunk((Seq(0, "after"),)))
        after = await _get(inbox)
        left = list(inbox.chunks)
        sender.close()
        await channel.aclose()
        return before.seqs[0].text, after.seqs[0].text, left

    with caplog.at_level(logging.WARNING, logger="vtoken.token_channel"):
        assert run(main()) == ("before", "after", [])
    (line,) = _warnings(caplog)
    assert line.exc_info is None and "Traceback" not in caplog.text
    assert "dropped 1 malformed frame" in line.getMessage() and "\n" not in line.getMessage()


def test_a_flood_of_malformed_frames_is_one_line_a_second_with_its_count(caplog):
    now = 0.0
    drops = DropLog(interval=1.0, clock=lambda: now)
    with caplog.at_level(logging.WARNING, logger="vtoken.token_channel"):
        for i in range(1000):
            now = i / 256  # 256 frames a second, exact in binary: a line at frames 0, 256, 512 and 768
            drops.drop("had 1 parts, not 2")
    counts = [int(r.getMessage().split("dropped ")[1].split()[0]) for r in _warnings(caplog)]
    assert counts == [1, 256, 256, 256] and drops.dropped == 1000 - 769


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
        assert d.channel.address.endpoint.startswith("tcp://127.0.0.1:") and not d._remote
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
    from cluster.serving.dispatch import coalesce

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
