"""kvhandoff.Connector in two OS processes over transport="nixl" (``pd_worker.py``): push and
pull with every byte checked on D, and a prefill engine SIGKILLed mid-run (D's requests fail
typed, D goes on with a fresh P).

    source scripts/nixl-env.sh && python -m pytest python/tests/test_nixl_processes.py -q

Every wait has a deadline; child processes are killed in a ``finally``.
"""

from __future__ import annotations

import time

import pytest

kvhandoff = pytest.importorskip("kvhandoff", reason="the native extension is not built")

from conftest import (  # noqa: E402
    BLOCK_TOKENS,
    DEADLINE_S,
    needs_nixl,
    nixl_ready,
    norm,
    unique,
)
from pd_worker import Engine  # noqa: E402

LEG = {"do_remote_decode": True}  # what the router sends with a prefill leg
PULL_LEG = {"do_remote_decode": True, "transfer_mode": "pull"}

# ---------------------------------------------------------------------------------------------
# Two processes over NIXL.

NIXL_BLOCKS, NIXL_BLOCK_BYTES = 64, 1024

#: A fence short enough for a test: heartbeats every 300 ms, a peer dead after 600 ms of
#: silence, and the quarantine (what frees D's blocks after a P died holding them) one
#: heartbeat above its floor (registration_ttl + heartbeat + max_message_delay + peer_timeout +
#: max_write_life = 3.9 s). Every engine of the kill test runs with it.
SHORT_FENCE = dict(
    heartbeat_interval_ms=300, peer_timeout_ms=600, registration_ttl_ms=1000,
    max_message_delay_ms=500, write_timeout_ms=1000, abandon_timeout_ms=500,
    max_write_life_ms=1500, quarantine_ms=4500,
)


def start_pair(p_id: str, d_id: str, **settings) -> tuple[Engine, Engine]:
    """P and D in processes of their own, each knowing the other."""
    kw = dict(transport="nixl", num_blocks=NIXL_BLOCKS, block_bytes=NIXL_BLOCK_BYTES, **settings)
    p = Engine("prefill", p_id, **kw)
    try:
        d = Engine("decode", d_id, **kw)
    except BaseException:
        p.stop()
        raise
    try:
        d.call("add_peer", p_id, p.address)  # (peers= is tested in one process)
        p.call("add_peer", d_id, d.address)
    except BaseException:
        d.stop()
        p.stop()
        raise
    return p, d


@pytest.fixture(scope="module")
def nixl_pair():
    """A P and a D process over NIXL, shared by the module's push and pull tests."""
    if not nixl_ready():
        pytest.skip("NIXL runtime env not set: source scripts/nixl-env.sh")
    p, d = start_pair(unique("prefill"), unique("decode"))
    try:
        yield p, d
    finally:
        d.stop()
        p.stop()


def handoff(p: Engine, d: Engine, n: int, leg: dict, prefix: str, first_index: int = 0,
            d_blocks: list[int] | None = None) -> dict[str, tuple[int, list[int]]]:
    """Runs ``n`` requests P → router → D and returns ``{rid: (index, d_ids)}``."""
    d_pool = list(d_blocks if d_blocks is not None else range(NIXL_BLOCKS - 1, -1, -1))
    p_pool = list(range(NIXL_BLOCKS))
    out = {}
    for k in range(n):
        i = first_index + k
        nb = 1 + i % 4
        p_ids = [p_pool.pop(0) for _ in range(nb)]
        d_ids = [d_pool.pop(0) for _ in range(nb)]
        rid = f"{prefix}-{i}"
        tokens = nb * BLOCK_TOKENS - i % 7
        _, _, answer = p.call("finish", rid, i, p_ids, dict(leg), tokens)
        d.call("allocate", rid, i, d_ids, answer, answer["remote_num_tokens"])
        out[rid] = (i, d_ids)
    return out


def assert_delivered(events, want, kind: str) -> None:
    got = {e["request_id"]: (e, v) for e, v in events if e["final"]}
    for rid, (_, d_ids) in want.items():
        e, verdict = got[rid]
        assert e["kind"] == kind, e
        if kind == "imported":
            assert e["outcome"] == "loaded", e
        assert e["blocks"] == [d_ids], e
        assert verdict == "ok", f"{rid}: {verdict}"


@needs_nixl
def test_nixl_two_processes_push(nixl_pair):
    p, d = nixl_pair
    _, before = d.call("metrics")
    want = handoff(p, d, 16, LEG, "npush")
    assert_delivered(d.wait_final(len(want), DEADLINE_S), want, "blocks_ready")
    p_events = p.wait_final(len(want), DEADLINE_S)
    assert all(e["kind"] == "blocks_free" and e["released"] is None for e, _ in p_events)
    _, after = d.call("metrics")
    moved = sum(len(ids) for _, ids in want.values()) * NIXL_BLOCK_BYTES * 2
    assert after["bytes_received"] - before["bytes_received"] >= moved, (before, after)
    assert after["requests_ready"] - before["requests_ready"] == len(want)


@needs_nixl
def test_nixl_two_processes_pull(nixl_pair):
    p, d = nixl_pair
    want = handoff(p, d, 12, PULL_LEG, "npull", first_index=100)
    assert_delivered(d.wait_final(len(want), DEADLINE_S), want, "imported")
    p_events = p.wait_final(len(want), DEADLINE_S)
    assert all(e["kind"] == "export_ended" for e, _ in p_events), p_events


@needs_nixl
def test_nixl_prefill_killed_mid_run():
    """SIGKILL P1 while D has requests registered with it: each is fenced by the death
    (``decode_fenced``, reason PeerDead) and ends with ``failed`` (same reason, blocks back)
    after D's quarantine; one allocated afterwards naming the dead P fails at once; D goes on
    with a fresh P2."""
    p1_id, d_id = unique("prefill"), unique("decode")
    p1, d = start_pair(p1_id, d_id, **SHORT_FENCE)
    p2 = None
    try:
        # Warm: the pair is connected and moves bytes.
        want = handoff(p1, d, 2, LEG, "warm")
        assert_delivered(d.wait_final(2, DEADLINE_S), want, "blocks_ready")
        p1.wait_final(2, DEADLINE_S)

        # D registers 4 requests with P1 (D first); P1 never finishes them.
        host, port = p1.address.rsplit(":", 1)
        to_p1 = {"do_remote_prefill": True, "remote_engine_id": p1_id, "remote_host": host,
                 "remote_port": int(port), "tp_size": 1}
        pending = {f"pend-{k}": [40 + 2 * k, 41 + 2 * k] for k in range(4)}
        for k, (rid, ids) in enumerate(pending.items()):
            d.call("allocate", rid, 200 + k, ids, {**to_p1, "transfer_id": unique("t")}, 32)
        time.sleep(0.5)  # the registrations reach P1: D's blocks are exposed to it
        d.call("metrics")  # (collects D's events so far)
        assert not [e for e, _ in d.events if e["request_id"] in pending], d.events

        killed = time.monotonic()
        p1.kill()

        # Every pending request is told at once (fenced by P1's death) ...
        def told(evs):
            return set(pending) <= {e["request_id"] for e, _ in evs}

        events = d.wait(told, 15.0)
        fenced_after = time.monotonic() - killed
        # ... and ends with `failed` once D's quarantine passed.
        def ended(evs):
            return set(pending) <= {e["request_id"] for e, _ in evs if e["final"]}

        events += d.wait(ended, 20.0)
        failed_after = time.monotonic() - killed
        for rid, ids in pending.items():
            mine = [e for e, _ in events if e["request_id"] == rid]
            kinds = [e["kind"] for e in mine]
            assert kinds in (["decode_fenced", "failed"], ["failed"]), mine
            for e in mine:
                assert norm(e["reason"]) == "peerdead", e
            assert mine[-1]["final"] is True and mine[-1]["blocks"] == [ids], mine
            assert mine[0]["final"] is (len(mine) == 1), mine
            assert norm(mine[-1]["proof"]) in ("deadpeerfence", "quarantine"), mine
        print(f"P1 killed: D's requests fenced after {fenced_after:.2f} s, "
              f"failed (blocks back) after {failed_after:.2f} s")
        assert fenced_after < 10, fenced_after
        # The blocks P1 may still have been writing were not handed back before the fence.
        assert failed_after >= SHORT_FENCE["quarantine_ms"] / 1000, failed_after

        # A request allocated now naming the dead P1 fails at once (never exposed: blocks back).
        d.call("allocate", "after-kill", 300, [50], {**to_p1, "transfer_id": unique("t")}, 16)
        events = d.wait(lambda evs: any(e["request_id"] == "after-kill" and e["final"]
                                        for e, _ in evs), 20.0)
        late = [e for e, _ in events if e["request_id"] == "after-kill"]
        assert late[-1]["kind"] == "failed", late
        assert norm(late[-1]["reason"]) in ("handshakefailed", "peerdead"), late
        assert late[-1]["blocks"] == [[50]], late

        # D goes on with a fresh P (blocks clear of the fenced ones).
        p2_id = unique("prefill")
        p2 = Engine("prefill", p2_id, transport="nixl", num_blocks=NIXL_BLOCKS,
                    block_bytes=NIXL_BLOCK_BYTES, **SHORT_FENCE)
        p2.call("add_peer", d_id, d.address)
        d.call("add_peer", p2_id, p2.address)
        want = handoff(p2, d, 8, LEG, "fresh", first_index=400, d_blocks=list(range(0, 40)))
        events = d.wait(lambda evs: set(want) <= {e["request_id"] for e, _ in evs if e["final"]},
                        DEADLINE_S)
        assert_delivered([(e, v) for e, v in events if e["request_id"] in want], want,
                         "blocks_ready")
        assert {e["request_id"] for e, _ in events} == set(want), events
        p2.wait_final(len(want), DEADLINE_S)
    finally:
        for engine in (p2, d, p1):
            if engine is not None:
                engine.stop(5)


@needs_nixl
def test_nixl_two_processes_decode_registers_first(nixl_pair):
    """D's registration reaches P before P's prefill finished (the router pairs by
    ``transfer_id``): P writes when it finishes; every byte checked on D."""
    p, d = nixl_pair
    host, port = p.address.rsplit(":", 1)
    want = {}
    for k in range(6):
        i, rid = 200 + k, f"dfirst-{k}"
        d_ids = [40 + 2 * k, 41 + 2 * k]
        early = {"do_remote_prefill": True, "remote_engine_id": p.engine_id, "remote_host": host,
                 "remote_port": int(port), "tp_size": 1, "transfer_id": f"key-{rid}"}
        d.call("allocate", rid, i, d_ids, early, 2 * BLOCK_TOKENS)
        want[rid] = (i, d_ids)
    time.sleep(0.2)  # the registrations are with P before any prefill finishes
    for k in range(6):
        rid = f"dfirst-{k}"
        p.call("finish", rid, 200 + k, [2 * k, 2 * k + 1],
               {"do_remote_decode": True, "transfer_id": f"key-{rid}"}, 2 * BLOCK_TOKENS)
    assert_delivered(d.wait_final(len(want), DEADLINE_S), want, "blocks_ready")
    assert all(e["kind"] == "blocks_free" and e["released"] is None
               for e, _ in p.wait_final(len(want), DEADLINE_S))


@needs_nixl
def test_nixl_two_processes_aborts(nixl_pair):
    """An abort on D while its KV has not come (P not finished yet), and an abort on P of a
    finished request D never registers: both hand their blocks back, and the pair goes on."""
    p, d = nixl_pair
    host, port = p.address.rsplit(":", 1)
    early = {"do_remote_prefill": True, "remote_engine_id": p.engine_id, "remote_host": host,
             "remote_port": int(port), "tp_size": 1, "transfer_id": "key-abort-d"}
    d.call("allocate", "abort-d", 300, [50, 51], early, 2 * BLOCK_TOKENS)
    d.call("abort", "abort-d")
    (event, _), = d.wait_final(1, DEADLINE_S)
    assert event["request_id"] == "abort-d" and event["kind"] == "failed", event
    assert event["reason"] == "Aborted" and event["blocks"] == [[50, 51]], event
    p.call("finish", "abort-p", 301, [20, 21], dict(LEG), 2 * BLOCK_TOKENS)
    p.call("abort", "abort-p")
    (event, _), = p.wait_final(1, DEADLINE_S)
    assert event["request_id"] == "abort-p" and event["kind"] == "blocks_free", event
    assert event["released"] is not None and event["blocks"] == [[20, 21]], event
    want = handoff(p, d, 4, LEG, "after-aborts", first_index=310)
    assert_delivered(d.wait_final(len(want), DEADLINE_S), want, "blocks_ready")
    p.wait_final(len(want), DEADLINE_S)
