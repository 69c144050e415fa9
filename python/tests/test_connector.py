"""The Python layer of kvhandoff (``kvhandoff.Connector`` over the native extension).

In one process over transport="mem": push (every byte checked; block ids as lists, nested lists
and numpy arrays; several regions), pull, a bidirectional turn, both orders of the race, aborts
on each side, the typed exceptions, the context manager, torch and raw regions, the GIL, and the
process's metrics. Two OS processes over NIXL: ``test_nixl_processes.py``.

    source scripts/nixl-env.sh && python -m pytest python/tests/test_connector.py -q

Every wait has a deadline; child processes are killed in a ``finally``.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

kvhandoff = pytest.importorskip("kvhandoff", reason="the native extension is not built")

from conftest import (  # noqa: E402
    BLOCK_TOKENS,
    check,
    fill,
    make_pair,
    norm,
    pattern,
    quiet,
    regions,
    unique,
    wait_final,
)

LEG = {"do_remote_decode": True}  # what the router sends with a prefill leg
PULL_LEG = {"do_remote_decode": True, "transfer_mode": "pull"}


def only_final(events: list[dict], request_id: str) -> dict:
    """The request's one event, which must be final."""
    mine = [e for e in events if e["request_id"] == request_id]
    assert len(mine) == 1, f"{request_id}: one event expected, got {mine}"
    assert mine[0]["final"] is True, mine[0]
    return mine[0]


# ---------------------------------------------------------------------------------------------
# Push, one process.


def block_ids_as(form: int, ids: list[int]):
    """The same block ids in the forms an engine passes: list, numpy (two dtypes), groups."""
    return [
        list(ids),
        np.array(ids, dtype=np.int64),
        [list(ids)],
        np.array(ids, dtype=np.uint32),
        np.array([ids], dtype=np.int32),  # one group, as a 2-D array
    ][form % 5]


def test_push_every_byte_many_requests(mem_pair):
    pair, pr, dr = mem_pair
    p, d = pair.p, pair.d
    before = kvhandoff.metrics()
    n, bb = 15, pair.block_bytes
    p_free, d_free = list(range(64)), list(range(63, -1, -1))  # D's ids differ from P's
    want: dict[str, tuple[int, list[int], list[int]]] = {}
    total_blocks = 0
    for i in range(n):
        nb = 1 + i % 4
        p_ids = [p_free.pop(0) for _ in range(nb)]
        d_ids = [d_free.pop(0) for _ in range(nb)]
        total_blocks += nb
        fill(pr, i, p_ids)
        rid = f"push-{i}"
        tokens = nb * BLOCK_TOKENS - i % BLOCK_TOKENS
        answer = p.request_finished(rid, block_ids_as(i, p_ids), dict(LEG), tokens)
        assert answer["do_remote_prefill"] is True, answer
        assert answer["remote_engine_id"] == p.engine_id, answer
        assert f"{answer['remote_host']}:{answer['remote_port']}" == p.address, answer
        assert answer["remote_num_tokens"] == tokens, answer
        assert answer["tp_size"] == 1, answer
        d.request_allocated(rid, block_ids_as(i + 2, d_ids), answer, answer["remote_num_tokens"])
        want[rid] = (i, p_ids, d_ids)
    assert d.has_pending_work() and p.has_pending_work()

    d_events, p_events = wait_final(d, n), wait_final(p, n)
    for rid, (i, p_ids, d_ids) in want.items():
        ready = only_final(d_events, rid)
        assert ready["kind"] == "blocks_ready", ready
        assert ready["blocks"] == [d_ids], ready
        assert check(dr, i, d_ids) is None, f"{rid}: {check(dr, i, d_ids)}"
        free = only_final(p_events, rid)
        assert free["kind"] == "blocks_free", free
        assert free["released"] is None, free
        assert free["blocks"] == [p_ids], free
    assert not d.has_pending_work() and not p.has_pending_work()
    # D's blocks not handed to any request are untouched.
    for region in dr:
        assert not region[: 64 - total_blocks].any()

    after = kvhandoff.metrics()
    moved = total_blocks * bb * len(pr)
    assert after["requests_ready"] - before["requests_ready"] == n, (before, after)
    assert after["bytes_sent"] - before["bytes_sent"] >= moved, (before, after)
    assert after["bytes_received"] - before["bytes_received"] >= moved, (before, after)


def test_metrics_names_and_types():
    m = kvhandoff.metrics()
    for name in (
        "requests_ready", "requests_failed", "requests_sent", "requests_released",
        "requests_expired", "bytes_sent", "bytes_received",
    ):
        assert isinstance(m.get(name), int), (name, m)
    assert isinstance(kvhandoff.clock_secs(), float)
    text = kvhandoff.prometheus_text()
    # The same figure, as Prometheus text: the receiving side's ready requests.
    line = next(
        l for l in text.splitlines()
        if l.startswith('kvhandoff_requests_total{') and 'outcome="ready"' in l
    )
    assert int(float(line.rsplit(" ", 1)[1])) == kvhandoff.metrics()["requests_ready"], line


@pytest.mark.parametrize("count", [1, 4])
def test_push_regions(count):
    """One region, and four moved together (block ``b`` of every region)."""
    pair, pr, dr = make_pair(num_blocks=16, block_bytes=256, count=count)
    try:
        fill(pr, 7, [3, 4, 5])
        answer = pair.p.request_finished("r", [3, 4, 5], dict(LEG))
        pair.d.request_allocated("r", [9, 1, 12], answer)
        ready = only_final(wait_final(pair.d, 1), "r")
        assert ready["kind"] == "blocks_ready"
        assert check(dr, 7, [9, 1, 12]) is None
        assert only_final(wait_final(pair.p, 1), "r")["kind"] == "blocks_free"
    finally:
        pair.close()


# ---------------------------------------------------------------------------------------------
# Pull and bidirectional turns, one process.


def test_pull_every_byte(mem_pair):
    pair, pr, dr = mem_pair
    p, d = pair.p, pair.d
    want = {}
    for i in range(6):
        nb = 1 + i % 3
        p_ids = list(range(10 * i, 10 * i + nb))
        d_ids = list(range(63 - 10 * i, 63 - 10 * i - nb, -1))
        fill(pr, 50 + i, p_ids)
        rid = f"pull-{i}"
        tokens = nb * BLOCK_TOKENS - 3
        answer = p.request_finished(rid, np.array(p_ids), dict(PULL_LEG), tokens)
        assert answer["transfer_mode"] == "pull", answer
        assert answer["remote_block_ids"] == [p_ids], answer
        assert answer["remote_num_tokens"] == tokens, answer
        assert answer["remote_blocks_expiry_time"] > kvhandoff.clock_secs(), answer
        d.request_allocated(rid, d_ids, answer, tokens)
        want[rid] = (50 + i, p_ids, d_ids)
    d_events, p_events = wait_final(d, len(want)), wait_final(p, len(want))
    for rid, (index, p_ids, d_ids) in want.items():
        imported = only_final(d_events, rid)
        assert imported["kind"] == "imported", imported
        assert imported["outcome"] == "loaded", imported
        assert imported["blocks"] == [d_ids], imported
        assert check(dr, index, d_ids) is None, f"{rid}: {check(dr, index, d_ids)}"
        ended = only_final(p_events, rid)
        assert ended["kind"] == "export_ended", ended
        assert ended["blocks"] == [p_ids], ended


def test_bidirectional_turn(mem_pair):
    """Turn 1 pushed P→D; D keeps the conversation's blocks; turn 2's prefill on P reads them."""
    pair, pr, dr = mem_pair
    p, d = pair.p, pair.d
    p_ids, d_ids = [0, 1], [20, 21, 22]
    fill(pr, 1, p_ids)
    answer = p.request_finished("conv-t1", p_ids, dict(LEG), 2 * BLOCK_TOKENS)
    d.request_allocated("conv-t1", d_ids[:2], answer)
    assert only_final(wait_final(d, 1), "conv-t1")["kind"] == "blocks_ready"
    assert only_final(wait_final(p, 1), "conv-t1")["kind"] == "blocks_free"
    assert check(dr, 1, d_ids[:2]) is None

    # D decodes: the conversation's KV is now D's own, 3 blocks of it.
    fill(dr, 2, d_ids)
    tokens = 3 * BLOCK_TOKENS - 5
    nxt = d.keep_for_next_turn("conv-t1", d_ids, answer, tokens, ttl_s=30.0)
    assert nxt["transfer_mode"] == "pull", nxt
    assert nxt["do_remote_decode"] is True, nxt
    assert nxt["remote_engine_id"] == d.engine_id, nxt
    assert nxt["remote_block_ids"] == [d_ids], nxt
    assert nxt["remote_num_tokens"] == tokens, nxt
    assert nxt.get("transfer_id"), nxt

    # Turn 2: the router sends nxt with the prefill leg; P allocates blocks and reads.
    p_turn2 = [40, 41, 42]
    p.next_turn_allocated("conv-t2", np.array(p_turn2), nxt, tokens)
    imported = only_final(wait_final(p, 1), "conv-t2")
    assert imported["kind"] == "imported" and imported["outcome"] == "loaded", imported
    assert imported["blocks"] == [p_turn2], imported
    assert check(pr, 2, p_turn2) is None
    ended = only_final(wait_final(d, 1), "conv-t1")
    assert ended["kind"] == "export_ended", ended
    assert ended["blocks"] == [d_ids], ended


def test_decline_export(mem_pair):
    """A reader that recomputes instead lets the holder's blocks go; no event on the reader."""
    pair, _, _ = mem_pair
    answer = pair.p.request_finished("dec", [5, 6], dict(PULL_LEG))
    pair.d.decline_export("dec", answer)
    ended = only_final(wait_final(pair.p, 1), "dec")
    assert ended["kind"] == "export_ended" and ended["blocks"] == [[5, 6]], ended
    assert quiet(pair.d, 0.2) == []


# ---------------------------------------------------------------------------------------------
# The races, one process.


@pytest.mark.parametrize("paired_by", ["transfer_id", "request_id"])
def test_race_decode_registers_first(mem_pair, paired_by):
    pair, pr, dr = mem_pair
    p, d = pair.p, pair.d
    if paired_by == "transfer_id":  # the router's key; each engine its own request id
        tid = unique("xfer")
        d_rid, p_rid, extra = "race-d", "race-p", {"transfer_id": tid}
    else:  # no key: the request ids pair
        d_rid = p_rid = "race"
        extra = {}
    d.request_allocated(d_rid, [30, 31], pair.prefill_params(**extra), 2 * BLOCK_TOKENS)
    assert quiet(d, 0.3) == []  # registered with P, waiting for the prefill
    assert d.has_pending_work()
    fill(pr, 9, [2, 3])
    answer = p.request_finished(p_rid, [2, 3], {**LEG, **extra}, 2 * BLOCK_TOKENS)
    if paired_by == "transfer_id":
        assert answer["transfer_id"] == extra["transfer_id"], answer
    ready = only_final(wait_final(d, 1), d_rid)
    assert ready["kind"] == "blocks_ready" and ready["blocks"] == [[30, 31]], ready
    assert check(dr, 9, [30, 31]) is None
    free = only_final(wait_final(p, 1), p_rid)
    assert free["kind"] == "blocks_free" and free["released"] is None, free


@pytest.mark.parametrize("with_transfer_id", [False, True])
def test_race_prefill_finishes_first(mem_pair, with_transfer_id):
    pair, pr, dr = mem_pair
    p, d = pair.p, pair.d
    extra = {"transfer_id": unique("xfer")} if with_transfer_id else {}
    fill(pr, 11, [7])
    answer = p.request_finished("first", [7], {**LEG, **extra}, 10)
    assert quiet(p, 0.3) == []  # held under its lease until D registers
    assert p.has_pending_work()
    d.request_allocated("first", [8], answer, 10)
    assert only_final(wait_final(d, 1), "first")["kind"] == "blocks_ready"
    assert check(dr, 11, [8]) is None
    assert only_final(wait_final(p, 1), "first")["kind"] == "blocks_free"


# ---------------------------------------------------------------------------------------------
# Layer-wise push, one process: 8 regions (one per layer), written in 4 parts of 2 layers.

LAYERS = 8


def layerwise_pair(**kwargs):
    kwargs.setdefault("layerwise_parts", 4)
    kwargs.setdefault("layerwise_min_tokens", 64)
    return make_pair(num_blocks=16, block_bytes=256, count=LAYERS, **kwargs)


def fill_layer(regions_, layer: int, index: int, ids: list[int]) -> None:
    """The forward pass writing one layer's KV: that layer's region of every block."""
    for nth, block in enumerate(ids):
        regions_[layer][block] = pattern(index, layer, nth, regions_[layer].shape[1])


def layer_holds(regions_, layer: int, index: int, ids: list[int]) -> bool:
    return all(
        np.array_equal(regions_[layer][b], pattern(index, layer, nth, regions_[layer].shape[1]))
        for nth, b in enumerate(ids)
    )


def wait_until(what, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.002)
    return what()


def test_layerwise_push_every_byte():
    """D registers first; P starts the prefill, writes and reports its layers one by one; each
    part (2 layers) lands on D as soon as it is ready, and D is ready only after the last."""
    pair, pr, dr = layerwise_pair()
    p, d = pair.p, pair.d
    try:
        assert p.layers == LAYERS and d.layers == LAYERS
        tokens = 100  # at least layerwise_min_tokens (64): four parts
        p_ids, d_ids = [2, 3, 4, 5, 6, 7, 8], [11, 5, 0, 1, 12, 13, 14]  # 7 blocks of 16 tokens
        d.request_allocated("lw", d_ids, pair.prefill_params(transfer_id="lw-t"), tokens)
        answer = p.prefill_started("lw", p_ids, {**LEG, "transfer_id": "lw-t"}, tokens)
        assert answer["do_remote_prefill"] is True and answer["remote_num_tokens"] == tokens, answer
        assert answer["transfer_id"] == "lw-t" and answer["remote_request_id"] == "lw", answer
        for layer in range(LAYERS):
            fill_layer(pr, layer, 9, p_ids)
            p.layers_ready("lw", layer + 1)
            if layer == 1:  # the first part (layers 0-1) is out before the prefill goes on
                assert wait_until(lambda: layer_holds(dr, 0, 9, d_ids) and layer_holds(dr, 1, 9, d_ids))
                assert not layer_holds(dr, 2, 9, d_ids)
            if layer == LAYERS - 2:
                assert [e for e in quiet(d, 0.1) if e["final"]] == []  # one part still to come
        ready = only_final(wait_final(d, 1), "lw")
        assert ready["kind"] == "blocks_ready" and ready["blocks"] == [d_ids], ready
        assert check(dr, 9, d_ids) is None, check(dr, 9, d_ids)
        free = only_final(wait_final(p, 1), "lw")
        assert free["kind"] == "blocks_free" and free["released"] is None, free
        assert free["blocks"] == [p_ids], free
        assert not p.has_pending_work() and not d.has_pending_work()
    finally:
        pair.close()


def test_layerwise_push_p_first_then_d():
    """P reports every layer before D registers: the whole request goes when D comes."""
    pair, pr, dr = layerwise_pair()
    p, d = pair.p, pair.d
    try:
        answer = p.prefill_started("lw-late", np.array([1, 2]), dict(LEG), 2 * BLOCK_TOKENS + 70)
        for layer in range(LAYERS):
            fill_layer(pr, layer, 4, [1, 2])
            p.layers_ready("lw-late", layer + 1)
        d.request_allocated("lw-late", [7, 8], answer, answer["remote_num_tokens"])
        assert only_final(wait_final(d, 1), "lw-late")["kind"] == "blocks_ready"
        assert check(dr, 4, [7, 8]) is None
        assert only_final(wait_final(p, 1), "lw-late")["kind"] == "blocks_free"
    finally:
        pair.close()


def test_layerwise_below_the_threshold_goes_as_one_part():
    pair, pr, dr = layerwise_pair()
    p, d = pair.p, pair.d
    try:
        tokens = 40  # below layerwise_min_tokens (64)
        d.request_allocated("lw-short", [9, 10, 11], pair.prefill_params(), tokens)
        answer = p.prefill_started("lw-short", [0, 1, 2], dict(LEG), tokens)
        assert answer["remote_num_tokens"] == tokens, answer
        for layer in range(LAYERS - 1):
            fill_layer(pr, layer, 6, [0, 1, 2])
            p.layers_ready("lw-short", layer + 1)
        assert quiet(d, 0.15) == []
        assert not dr[0].any(), "nothing is written before the last layer"
        fill_layer(pr, LAYERS - 1, 6, [0, 1, 2])
        p.layers_ready("lw-short", LAYERS)
        assert only_final(wait_final(d, 1), "lw-short")["kind"] == "blocks_ready"
        assert check(dr, 6, [9, 10, 11]) is None
        assert only_final(wait_final(p, 1), "lw-short")["kind"] == "blocks_free"
    finally:
        pair.close()


def test_layerwise_decode_aborts_mid_prefill():
    """D gives up after the first part: P's request ends (blocks_free, not sent), and P's later
    reports of it are taken and do nothing."""
    pair, pr, dr = layerwise_pair()
    p, d = pair.p, pair.d
    try:
        d.request_allocated("lw-ab", [3, 4, 5, 6, 7], pair.prefill_params(), 80)
        p.prefill_started("lw-ab", [8, 9, 10, 11, 12], dict(LEG), 80)
        for layer in range(2):
            fill_layer(pr, layer, 2, [8, 9, 10, 11, 12])
            p.layers_ready("lw-ab", layer + 1)
        d.abort("lw-ab")
        failed = only_final(wait_final(d, 1), "lw-ab")
        assert failed["kind"] == "failed" and norm(failed["reason"]) == "aborted", failed
        free = only_final(wait_final(p, 1), "lw-ab")
        assert free["kind"] == "blocks_free" and free["released"] is not None, free
        assert free["blocks"] == [[8, 9, 10, 11, 12]], free
        for layer in range(2, LAYERS):  # the forward pass goes on: its reports are accepted
            p.layers_ready("lw-ab", layer + 1)
        assert quiet(p, 0.1) == []
        assert not p.has_pending_work() and not d.has_pending_work()
    finally:
        pair.close()


def test_layerwise_errors():
    pair, _, _ = layerwise_pair()
    p = pair.p
    try:
        with pytest.raises(kvhandoff.Rejected):
            p.layers_ready("never-started", 1)
        with pytest.raises(kvhandoff.InvalidParams) as e:
            p.prefill_started("lw-pull", [1], dict(PULL_LEG), 16)
        assert "transfer_mode" in str(e.value)
        p.prefill_started("lw-x", [1], dict(LEG), 16)
        with pytest.raises(kvhandoff.InvalidParams) as e:
            p.layers_ready("lw-x", LAYERS + 1)
        assert "ready" in str(e.value)
        with pytest.raises(kvhandoff.Rejected):  # started once only
            p.prefill_started("lw-x", [2], dict(LEG), 16)
        p.abort("lw-x")
        assert only_final(wait_final(p, 1), "lw-x")["kind"] == "blocks_free"
    finally:
        pair.close()


# ---------------------------------------------------------------------------------------------
# Aborts, one process.


def test_abort_on_decode(mem_pair):
    """D registered, P never finishes; D's abort hands the blocks back with a final event."""
    pair, _, _ = mem_pair
    d = pair.d
    d.request_allocated("ab-d", [4, 5, 6], pair.prefill_params(), 3 * BLOCK_TOKENS)
    assert quiet(d, 0.2) == []
    d.abort("ab-d")
    failed = only_final(wait_final(d, 1), "ab-d")
    assert failed["kind"] == "failed", failed
    assert norm(failed["reason"]) == "aborted", failed
    assert failed["blocks"] == [[4, 5, 6]], failed
    assert not d.has_pending_work()
    assert quiet(pair.p, 0.2) == []  # P never started the request: no event there


def test_abort_on_prefill(mem_pair):
    """P finished, no D comes; P's abort releases the blocks unsent."""
    pair, _, _ = mem_pair
    p = pair.p
    p.request_finished("ab-p", [1, 2], dict(LEG))
    p.abort("ab-p")
    free = only_final(wait_final(p, 1), "ab-p")
    assert free["kind"] == "blocks_free", free
    assert free["released"] is not None and "abort" in norm(free["released"]), free
    assert free["blocks"] == [[1, 2]], free
    assert not p.has_pending_work()


def test_abort_of_an_export(mem_pair):
    pair, _, _ = mem_pair
    pair.p.request_finished("ab-x", [3], dict(PULL_LEG))
    pair.p.abort("ab-x")
    ended = only_final(wait_final(pair.p, 1), "ab-x")
    assert ended["kind"] == "export_ended" and ended["blocks"] == [[3]], ended


def test_abort_unknown_request_is_rejected(mem_pair):
    pair, _, _ = mem_pair
    with pytest.raises(kvhandoff.Rejected):
        pair.p.abort("never-seen")
    with pytest.raises(kvhandoff.Rejected):
        pair.d.abort("never-seen")


# ---------------------------------------------------------------------------------------------
# Typed exceptions.


@pytest.mark.parametrize(
    "key, change",
    [
        ("remote_engine_id", lambda q: q.pop("remote_engine_id")),
        ("do_remote_prefill", lambda q: q.update(do_remote_prefill=False)),
        ("tp_size", lambda q: q.pop("tp_size")),
        ("remote_host", lambda q: q.pop("remote_host")),
        ("remote_port", lambda q: q.pop("remote_port")),
        ("remote_port", lambda q: q.update(remote_port="not a port")),
        ("transfer_mode", lambda q: q.update(transfer_mode="carrier-pigeon")),
        ("epoch", lambda q: q.update(epoch=0)),
        ("remote_block_ids", lambda q: q.update(transfer_mode="pull")),  # pull needs them
    ],
)
def test_invalid_params_name_the_key(mem_pair, key, change):
    pair, _, _ = mem_pair
    params = pair.prefill_params()
    change(params)
    with pytest.raises(kvhandoff.InvalidParams) as e:
        pair.d.request_allocated("bad", [1], params, 4)
    assert key in str(e.value), (key, str(e.value))
    assert isinstance(e.value, kvhandoff.KvHandoffError)
    assert isinstance(e.value.cause, str) and key in e.value.cause, e.value.cause
    # Nothing changed: the request id is free, and no event comes.
    assert not pair.d.has_pending_work()
    pair.d.request_allocated("bad", [1], pair.prefill_params(), 4)
    pair.d.abort("bad")
    assert only_final(wait_final(pair.d, 1), "bad")["kind"] == "failed"


def test_invalid_params_on_prefill(mem_pair):
    pair, _, _ = mem_pair
    with pytest.raises(kvhandoff.InvalidParams) as e:
        pair.p.request_finished("bad", [1], {"do_remote_decode": True, "transfer_mode": "smoke"})
    assert "transfer_mode" in str(e.value)
    with pytest.raises(kvhandoff.InvalidParams) as e:
        pair.p.next_turn_allocated("bad", [1], {**pair.prefill_params(), "transfer_mode": "push"})
    assert "transfer_mode" in str(e.value)
    assert not pair.p.has_pending_work()


def test_bad_block_ids(mem_pair):
    """Block ids that are not ids: a typed error, nothing started."""
    pair, _, _ = mem_pair
    for bad in ([-1], ["a"], [1.5], [[1], "x"], None):
        with pytest.raises((kvhandoff.KvHandoffError, TypeError, ValueError, OverflowError)):
            pair.p.request_finished("bad-ids", bad, dict(LEG))
    assert not pair.p.has_pending_work()


def test_block_ids_out_of_the_pool_touch_no_memory(mem_pair):
    """A block id past the pool (64 blocks) on either side: refused at the call, or the
    request fails typed on both sides (the transfer's post fails); no byte outside moves."""
    pair, pr, dr = mem_pair
    p, d = pair.p, pair.d
    fill(pr, 1, [0])
    for rid, p_ids, d_ids in (("oob-p", [64], [0]), ("oob-d", [0], [64])):
        try:
            answer = p.request_finished(rid, p_ids, dict(LEG))
        except kvhandoff.KvHandoffError:
            continue
        try:
            d.request_allocated(rid, d_ids, answer)
        except kvhandoff.KvHandoffError:
            p.abort(rid)
            assert only_final(wait_final(p, 1), rid)["kind"] == "blocks_free"
            continue
        failed = only_final(wait_final(d, 1), rid)
        assert failed["kind"] == "failed" and failed["blocks"] == [d_ids], failed
        free = only_final(wait_final(p, 1), rid)
        assert free["kind"] == "blocks_free" and free["released"] is not None, free
    assert not any(region.any() for region in dr)


def test_duplicate_request_is_rejected(mem_pair):
    pair, _, _ = mem_pair
    p, d = pair.p, pair.d
    p.request_finished("dup", [1, 2], dict(LEG))
    with pytest.raises(kvhandoff.Rejected):
        p.request_finished("dup", [3, 4], dict(LEG))
    d.request_allocated("dup-d", [9], pair.prefill_params(), 4)
    with pytest.raises(kvhandoff.Rejected):
        d.request_allocated("dup-d", [10], pair.prefill_params(), 4)
    # The first of each is untouched: its blocks come back once, with the first call's ids.
    p.abort("dup")
    d.abort("dup-d")
    assert only_final(wait_final(p, 1), "dup")["blocks"] == [[1, 2]]
    assert only_final(wait_final(d, 1), "dup-d")["blocks"] == [[9]]


def test_calls_after_close_are_unavailable():
    pair, _, _ = make_pair()
    p, d = pair.p, pair.d
    assert not p.closed
    p.close()
    p.close()  # idempotent
    assert p.closed
    with pytest.raises(kvhandoff.Unavailable):
        p.request_finished("late", [1], dict(LEG))
    with pytest.raises(kvhandoff.Unavailable):
        p.abort("late")
    # Nothing more can come once closed.
    assert p.has_pending_work() is False
    for call in (p.poll_events, lambda: p.wait_events(0.01), lambda: p.read_block(0, 0)):
        with pytest.raises(kvhandoff.Unavailable):
            call()
    assert "closed" in repr(p)
    d.close()
    with pytest.raises(kvhandoff.Unavailable):
        d.request_allocated("late", [1], pair.prefill_params(), 4)


def test_close_with_requests_in_flight_gives_up():
    """close() while requests are in progress returns, and later calls are Unavailable."""
    pair, _, _ = make_pair()
    pair.p.request_finished("inflight", [1], dict(LEG))
    pair.d.request_allocated("inflight-d", [2], pair.prefill_params(), 4)
    t = time.monotonic()
    pair.close()
    assert time.monotonic() - t < 15, "close took too long"
    assert pair.p.closed and pair.d.closed


def _connector(**over):
    args = dict(
        role="prefill", engine_id=unique("cfg"), regions=regions(8, 256, 1), block_bytes=256,
        transport="mem",
    )
    args.update(over)
    role, engine_id = args.pop("role"), args.pop("engine_id")
    return kvhandoff.Connector(role, engine_id, **args)


@pytest.mark.parametrize(
    "over",
    [
        {"role": "middle"},
        {"engine_id": ""},
        {"block_bytes": 0},
        {"block_bytes": 300},  # 8 × 256 B is not a whole number of 300 B blocks
        {"regions": []},
        {"regions": [np.zeros((8, 256), np.uint8), np.zeros((4, 256), np.uint8)]},
        {"regions": [b"\0" * 2048]},  # read-only
        {"regions": [np.zeros((8, 512), np.uint8)[:, ::2]]},  # not contiguous
        {"regions": [42]},
        {"transport": "carrier-pigeon"},
        {"listen": "not an address"},
        {"load_failure_policy": "pray"},
        {"layerwise_parts": 0},
        {"layerwise_min_tokens": -1},
    ],
    ids=[
        "role", "engine_id", "block_bytes=0", "block_bytes-not-dividing", "no-regions",
        "regions-of-unequal-blocks", "read-only-region", "non-contiguous-region", "int-region",
        "transport", "listen", "load_failure_policy", "layerwise_parts", "layerwise_min_tokens",
    ],
)
def test_bad_constructor_args_are_config_errors(over):
    with pytest.raises(kvhandoff.ConfigError) as e:
        _connector(**over).close()
    assert isinstance(e.value, kvhandoff.KvHandoffError)


@pytest.mark.parametrize(
    "setting",
    [
        {"lease_ms": 5000},  # alone, shorter than the default lease extension
        {"lease_ms": 60000},
        {"decode_deadline_ms": 20000},
        {"load_failure_policy": "recompute"},
        {"next_turn_ttl_s": 10.0},
        {"call_timeout_ms": 5000},
        {"handshake_timeout_ms": 3000},
        {"advertise_host": "10.1.2.3"},
        {"accept_any": True},
        {"peers": {"some-decode-0": "127.0.0.1:9"}},
        {"block_tokens": 32},
        {"model": "tiny", "dtype": "bfloat16"},
        {"listen": "0.0.0.0:0", "advertise_host": "127.0.0.1"},
        {"layerwise_parts": 2, "layerwise_min_tokens": 0},
    ],
    ids=lambda o: ",".join(o),
)
def test_documented_settings_are_accepted(setting):
    """Each keyword of the constructor's documented signature (``_native.pyi``), alone."""
    c = _connector(**setting)
    try:
        if "advertise_host" in setting:
            assert c.address.startswith(setting["advertise_host"] + ":"), c.address
    finally:
        c.close()


@pytest.mark.parametrize("setting", [{"layerwise_parts": 0}, {"layerwise_min_tokens": -1},
                                     {"layerwise_parts": "four"}])
def test_layerwise_settings_are_checked_by_name(setting):
    with pytest.raises(kvhandoff.ConfigError) as e:
        _connector(**setting)
    assert next(iter(setting)) in str(e.value)


def test_settings_layer_defaults_file_environment_keywords(tmp_path, monkeypatch):
    """One key table for the file's ``[rank]``, ``KVHANDOFF_RANK_*`` and the keywords, layered
    in that order over ``defaults``; each layer's errors name the layer. A lease of 400 ms with
    an extension of 500 ms contradicts itself: which layer wins decides whether it starts."""
    assert "lease_ms" in kvhandoff.SETTING_KEYS and "config_file" in kvhandoff.SETTING_KEYS
    for key in ("KVHANDOFF_RANK_LEASE_MS", "KVHANDOFF_RANK_LEASE_EXTENSION_MS"):
        monkeypatch.delenv(key, raising=False)
    path = tmp_path / "kvhandoff.toml"
    path.write_text("[node]\nrequests = 3\n\n[rank]\nlease_ms = 400\n")
    _connector(config_file=str(path)).close()  # the extension follows the unset lease
    with pytest.raises(kvhandoff.ConfigError) as e:  # the file's lease against defaults' 500
        _connector(config_file=str(path), defaults={"lease_extension_ms": 500})
    assert "contradict" in str(e.value)
    _connector(config_file=str(path), defaults={"lease_extension_ms": 500}, lease_extension_ms=300).close()
    monkeypatch.setenv("KVHANDOFF_RANK_LEASE_EXTENSION_MS", "300")  # the environment over defaults
    _connector(config_file=str(path), defaults={"lease_extension_ms": 500}).close()
    with pytest.raises(kvhandoff.ConfigError):  # a keyword over the environment
        _connector(config_file=str(path), lease_extension_ms=500)
    monkeypatch.setenv("KVHANDOFF_RANK_LEASE_EXTENSION_MS", "soon")
    with pytest.raises(kvhandoff.ConfigError) as e:
        _connector()
    assert "KVHANDOFF_RANK_LEASE_EXTENSION_MS" in str(e.value)
    monkeypatch.delenv("KVHANDOFF_RANK_LEASE_EXTENSION_MS")
    path.write_text("[rank]\nleese_ms = 400\n")
    with pytest.raises(kvhandoff.ConfigError) as e:
        _connector(config_file=str(path))
    assert "leese_ms" in str(e.value) and str(path) in str(e.value)
    with pytest.raises(kvhandoff.ConfigError) as e:
        _connector(config_file=str(tmp_path / "missing.toml"))
    assert "missing.toml" in str(e.value)
    for bad in ({"defaults": 5}, {"defaults": {"leese_ms": 1}}, {"integrity_digest": "maybe"},
                {"block_pairing": "diagonal"}, {"max_peers": 0}):
        with pytest.raises(kvhandoff.ConfigError) as e:
            _connector(**bad)
        assert "defaults" in str(e.value) or next(iter(bad)) in str(e.value), (bad, str(e.value))


def test_unknown_setting_is_a_config_error_naming_it():
    with pytest.raises(kvhandoff.ConfigError) as e:
        _connector(bogus_ms=5)
    assert "bogus_ms" in str(e.value)


def test_interpreter_exit_with_a_polling_thread(tmp_path):
    """An engine thread (daemon) still polling when the interpreter exits: a clean exit."""
    import subprocess
    import sys

    script = tmp_path / "exit_while_polling.py"
    script.write_text(
        "import threading, time, numpy as np, kvhandoff\n"
        "c = kvhandoff.Connector('decode', 'exit-d', regions=[np.zeros((4, 256), np.uint8)],\n"
        "                        block_bytes=256, transport='mem')\n"
        "def loop():\n"
        "    while True:\n"
        "        c.wait_events(0.005)\n"
        "threading.Thread(target=loop, daemon=True).start()\n"
        "time.sleep(0.2)\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])


def test_runtime_logs_on_request(tmp_path):
    """``KVHANDOFF_LOG`` wires the runtime's logs to stderr: JSON records carrying the request
    spans' trace ids on both sides; unset, nothing; a bad filter or format is a ConfigError at
    import, naming the variable."""
    import json as _json
    import os
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python", "handoff.py")
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVHANDOFF_LOG")}

    def run(env, *args):
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                              env={**base, **env})

    quiet = run({}, example, "--transport", "mem", "--requests", "2")
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "trace_id" not in quiet.stderr
    logged = run({"KVHANDOFF_LOG": "debug", "KVHANDOFF_LOG_FORMAT": "json"},
                 example, "--transport", "mem", "--requests", "2")
    assert logged.returncode == 0, logged.stderr[-2000:]
    records = [_json.loads(line) for line in logged.stderr.splitlines() if line.startswith("{")]
    traced = {span["trace_id"] for r in records for span in r.get("spans", []) if "trace_id" in span}
    assert len(traced) >= 2, logged.stderr[-2000:]
    for env, name in (({"KVHANDOFF_LOG": "kvhandoff=notalevel"}, "KVHANDOFF_LOG"),
                      ({"KVHANDOFF_LOG": "info", "KVHANDOFF_LOG_FORMAT": "xml"}, "KVHANDOFF_LOG_FORMAT")):
        bad = run(env, "-c", "import kvhandoff")
        assert bad.returncode != 0 and "ConfigError" in bad.stderr and name in bad.stderr, bad.stderr


def test_raw_region_contract_checks():
    with pytest.raises(kvhandoff.ConfigError):
        kvhandoff.RawRegion(0, 4096)
    with pytest.raises(kvhandoff.ConfigError):
        kvhandoff.RawRegion(0x1000, 0)
    torch = pytest.importorskip("torch")
    with pytest.raises(kvhandoff.ConfigError):
        _connector(regions=[torch.zeros(16, 256, dtype=torch.uint8).t()])  # not contiguous


# ---------------------------------------------------------------------------------------------
# The handle: context manager, properties, regions of every kind, block access, the GIL.


def test_context_manager_and_properties():
    kv = np.zeros((32, 1024), dtype=np.uint8)
    with kvhandoff.Connector("decode", "ctx-decode-0", regions=[kv, kv.copy()], block_bytes=1024,
                             transport="mem") as c:
        assert isinstance(c, kvhandoff.Connector)
        assert not c.closed
        assert c.role == "decode" and c.engine_id == "ctx-decode-0"
        assert c.num_blocks == 32 and c.block_bytes == 1024
        host, port = c.address.rsplit(":", 1)
        assert host and 0 < int(port) < 65536
        assert c.address in repr(c)
        assert c.poll_events() == [] and not c.has_pending_work()
    assert c.closed
    with pytest.raises(ZeroDivisionError):  # an exception in the block still closes it
        with kvhandoff.Connector("prefill", "ctx-prefill-0", regions=[kv], block_bytes=1024,
                                 transport="mem") as c2:
            1 / 0
    assert c2.closed


def test_torch_regions():
    """P's KV in bf16 torch tensors (by data_ptr), D's in numpy, 3 regions."""
    torch = pytest.importorskip("torch")
    blocks, shape = 16, (16, 2, 8)  # tokens, heads, head dim: 512 B of bf16 per block
    pt = [torch.zeros((blocks, *shape), dtype=torch.bfloat16) for _ in range(3)]
    views = [t.view(torch.uint8).reshape(blocks, -1).numpy() for t in pt]  # same memory
    dr = regions(blocks, 512, 3)
    p = kvhandoff.Connector("prefill", unique("torch-p"), regions=pt, block_bytes=512,
                            transport="mem")
    try:
        d = kvhandoff.Connector("decode", unique("torch-d"), regions=dr, block_bytes=512,
                                transport="mem", peers={p.engine_id: p.address})
        try:
            p.add_peer(d.engine_id, d.address)
            fill(views, 3, [5, 6])
            answer = p.request_finished("t", torch.tensor([5, 6]).numpy(), dict(LEG))
            d.request_allocated("t", [0, 15], answer)
            assert only_final(wait_final(d, 1), "t")["kind"] == "blocks_ready"
            assert check(dr, 3, [0, 15]) is None
            assert only_final(wait_final(p, 1), "t")["kind"] == "blocks_free"
            # D -> torch: the tensor bytes read back as the pattern.
            got = torch.from_numpy(dr[1][15].copy()).view(torch.bfloat16)
            assert torch.equal(got.view(torch.uint8), torch.from_numpy(pattern(3, 1, 1, 512)))
        finally:
            d.close()
    finally:
        p.close()


def test_raw_regions():
    """P's KV by raw pointer (ctypes memory), D's by RawRegion over numpy, kept alive by owner."""
    n = 8 * 256
    cbuf = (ctypes.c_uint8 * n)()
    p_view = np.frombuffer(cbuf, dtype=np.uint8).reshape(8, 256)
    d_arr = np.zeros((8, 256), dtype=np.uint8)
    raw_p = kvhandoff.RawRegion(ctypes.addressof(cbuf), n, owner=cbuf)
    raw_d = kvhandoff.RawRegion(d_arr.ctypes.data, d_arr.nbytes, owner=d_arr)
    assert "nbytes=2048" in repr(raw_p)
    with kvhandoff.Connector("prefill", unique("raw-p"), regions=[raw_p], block_bytes=256,
                             transport="mem") as p, \
         kvhandoff.Connector("decode", unique("raw-d"), regions=[raw_d], block_bytes=256,
                             transport="mem", peers={p.engine_id: p.address}) as d:
        p.add_peer(d.engine_id, d.address)
        fill([p_view], 21, [7, 0])
        answer = p.request_finished("raw", [7, 0], dict(LEG))
        d.request_allocated("raw", [1, 2], answer)
        assert only_final(wait_final(d, 1), "raw")["kind"] == "blocks_ready"
        assert check([d_arr], 21, [1, 2]) is None
        assert only_final(wait_final(p, 1), "raw")["kind"] == "blocks_free"
        assert p.num_blocks == 8


def test_write_and_read_block(mem_pair):
    pair, pr, _ = mem_pair
    p = pair.p
    data = bytes(range(256)) * 2
    p.write_block(1, 3, data)
    assert p.read_block(1, 3) == data
    assert bytes(pr[1][3]) == data  # the engine's own memory, no copy
    pr[0][5] = 0xAB
    assert p.read_block(0, 5) == b"\xab" * 512
    with pytest.raises(kvhandoff.RegionError):
        p.read_block(0, 64)
    with pytest.raises(kvhandoff.RegionError):
        p.read_block(2, 0)
    with pytest.raises(kvhandoff.RegionError):
        p.write_block(0, 64, data)
    with pytest.raises(kvhandoff.RegionError):
        p.write_block(0, 0, b"short")


def test_wait_events_releases_the_gil(mem_pair):
    pair, _, _ = mem_pair
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        start = time.monotonic()
        assert pair.d.wait_events(0.3) == []
        took = time.monotonic() - start
    finally:
        stop.set()
        t.join(5)
    assert 0.25 <= took < 5, took
    assert ticks[0] > 10_000, f"the other thread barely ran while wait_events waited: {ticks[0]}"


def test_warm_up_makes_the_handshake_before_the_first_request(mem_pair):
    """warm_up: D meets P before any request; a request then hands every byte over; a peer
    nobody knows, or one that is gone, raises Unavailable; a bad timeout is a ConfigError."""
    pair, pr, dr = mem_pair
    pair.d.warm_up(pair.p.engine_id, timeout=10.0)
    pair.d.warm_up(pair.p.engine_id)  # a repeat changes nothing
    fill(pr, 13, [3])
    answer = pair.p.request_finished("warm", [3], dict(LEG), 4)
    pair.d.request_allocated("warm", [5], answer, 4)
    assert only_final(wait_final(pair.d, 1), "warm")["kind"] == "blocks_ready"
    assert check(dr, 13, [5]) is None
    with pytest.raises(kvhandoff.Unavailable):
        pair.d.warm_up(unique("stranger"), timeout=2.0)
    for bad in (0.0, -1.0, float("nan"), 1e9):
        with pytest.raises(kvhandoff.ConfigError):
            pair.d.warm_up(pair.p.engine_id, timeout=bad)
    pair.p.close()
    with pytest.raises(kvhandoff.Unavailable):
        pair.d.warm_up(pair.p.engine_id, timeout=5.0)
