"""KV events reach each router's index at least once: a lost reply loses nothing, applying a
resend is harmless, a router that lost track (or a backlog past the limit) gets one full
listing flagged reset, and several routers acknowledge independently."""

from splitserve.engine.kv_cache.block_pool import BlockRemoved, BlockStored
from splitserve.worker.kv_events import EventOutbox, RouterOutboxes
from splitserve.router.kv_index import KVIndex
from tests.fakes.cluster import digest  # the outbox passes hashes through; the index wants digests


def _held(index: KVIndex, worker: str, hashes) -> list:
    return [h for h in hashes if index.overlap([digest(h)]).get(worker)]


def _apply(index: KVIndex, worker: str, events) -> None:
    index.apply(worker, [type(ev)(tuple(map(digest, ev.block_hashes))) for ev in events])


def _take(box: EventOutbox, ack, new, listing):
    box.record(new)
    return box.take(ack, listing)


def test_a_lost_reply_is_sent_again_and_applying_twice_is_harmless():
    box, index = EventOutbox(), KVIndex()
    listing = lambda: [BlockStored(())]  # noqa: E731
    seq0, ev0, reset0 = _take(box, None, [], listing)  # first contact: a listing (empty here)
    assert reset0 and ev0 == [BlockStored(())]
    seq1, ev1, reset = _take(box, seq0, [BlockStored((1, 2))], listing)
    assert (seq1, ev1, reset) == (seq0 + 1, [BlockStored((1, 2))], False)
    # the reply is lost: the router still acks seq0, so batch 1 comes again with batch 2
    seq2, ev2, _ = _take(box, seq0, [BlockRemoved((1,)), BlockStored((3,))], listing)
    assert seq2 == seq1 + 1 and ev2 == [BlockStored((1, 2)), BlockRemoved((1,)), BlockStored((3,))]
    _apply(index, "w", ev1)  # suppose the first reply did arrive after all: applied twice now
    _apply(index, "w", ev2)
    assert _held(index, "w", (1, 2, 3)) == [2, 3]
    assert _take(box, seq2, [], listing) == (seq2, [], False)  # acknowledged: nothing left to send


def test_a_backlog_past_the_limit_becomes_one_listing_until_acknowledged():
    box, index = EventOutbox(limit=3), KVIndex()
    _apply(index, "w", [BlockStored((9,))])  # stale: the worker dropped 9 in events the router never got
    state = {"cached": (1, 2, 3, 4)}
    listing = lambda: [BlockStored(state["cached"])]  # noqa: E731
    first = _take(box, None, [], listing).seq
    _take(box, first, [BlockStored((1, 2))], listing)
    box.record([BlockStored((3, 4)), BlockRemoved((9,))])  # 5 hashes > 3: the backlog goes at once
    assert box._size == 0 and not box._batches
    seq, events, reset = box.take(first, listing)
    assert reset and events == [BlockStored((1, 2, 3, 4))]
    state["cached"] = (1, 2, 3)  # the reply is lost and the cache moves on: a fresh listing comes again
    seq2, events2, reset2 = _take(box, first, [BlockRemoved((4,))], listing)
    assert reset2 and seq2 > seq and events2 == [BlockStored((1, 2, 3))]
    index.remove_worker("w")  # what the router does with a reset
    _apply(index, "w", events2)
    assert _held(index, "w", (1, 2, 3, 4, 9)) == [1, 2, 3]
    assert _take(box, seq2, [], listing) == (seq2, [], False)  # acknowledged: back to batches


def test_a_router_that_lost_track_gets_a_listing():
    """A router that forgot this worker (a failed call) or never knew it (new, restarted) acks
    None; one whose ack this worker never issued is as lost. Both get the whole cache."""
    box = EventOutbox()
    listing = lambda: [BlockStored((1, 2, 3))]  # noqa: E731
    seq = _take(box, None, [], listing).seq
    seq = _take(box, seq, [BlockStored((1, 2, 3))], listing).seq
    for ack in (None, seq + 100):
        out = box.take(ack, listing)
        assert out.reset and out.events == [BlockStored((1, 2, 3))]
    assert box.take(out.seq, listing) == (out.seq, [], False)


def test_routers_acknowledge_independently_and_silent_ones_are_dropped():
    boxes = RouterOutboxes(idle_s=60)
    listing = lambda: [BlockStored(())]  # noqa: E731
    a = boxes.take("a", None, [], listing, now=0)
    b = boxes.take("b", None, [], listing, now=0)
    a = boxes.take("a", a.seq, [BlockStored((1,))], listing, now=1)  # b was not there to drain these
    assert a.events == [BlockStored((1,))]
    b = boxes.take("b", b.seq, [BlockStored((2,))], listing, now=2)
    assert b.events == [BlockStored((1,)), BlockStored((2,))] and not b.reset  # a's ack took nothing from b
    a = boxes.take("a", a.seq, [], listing, now=3)
    assert a.events == [BlockStored((2,))]
    assert len(boxes) == 2
    boxes.take("a", a.seq, [], listing, now=100)  # b silent for 98 s: dropped
    assert len(boxes) == 1
    assert boxes.take("b", b.seq, [], listing, now=101).reset  # back: b starts over from a listing
