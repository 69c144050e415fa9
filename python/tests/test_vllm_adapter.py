"""The vLLM adapter's mapping (``kvhandoff.vllm``), driven with fakes: no vLLM, no native module.

Runs under pytest, or with a bare interpreter: ``python3 python/tests/test_vllm_adapter.py``.
The hooks are called in the order vLLM 0.32.0 calls them (scheduler:
get_num_new_matched_tokens → update_state_after_alloc → build_connector_meta; worker:
bind_connector_metadata → start_load_kv → wait_for_layer_load/save_kv_layer → wait_for_save →
get_transfer_results → clear_connector_metadata; scheduler: update_connector_output;
request_finished at the end).
"""

from __future__ import annotations

import enum
import importlib.util
import os
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(os.path.dirname(HERE), "kvhandoff")


def _load_adapter():
    """``kvhandoff.vllm``; loaded from its file when the package (its native module) is absent."""
    try:
        import kvhandoff.vllm as adapter  # noqa: PLC0415

        return adapter
    except ImportError:
        pass
    # The package's folder as a package of another name, without running its __init__ (which
    # loads the native module): the adapter and its relative imports load from their files.
    import types  # noqa: PLC0415

    name = "kvhandoff_standalone"
    package = types.ModuleType(name)
    package.__path__ = [PKG]
    sys.modules[name] = package
    return importlib.import_module(f"{name}.vllm")


A = _load_adapter()


class Status(enum.IntEnum):
    WAITING = 1
    WAITING_FOR_REMOTE_KVS = 3
    RUNNING = 5
    FINISHED_STOPPED = 7
    FINISHED_LENGTH_CAPPED = 8
    FINISHED_ABORTED = 9
    FINISHED_ERROR = 11


class FakeBlocks:
    def __init__(self, *groups):
        self.groups = [list(g) for g in groups]

    def get_unhashed_block_ids_all_groups(self):
        return [list(g) for g in self.groups]


class FakeTensor:
    """Enough of a CPU torch tensor for ``register_kv_caches``: [num_blocks, rest] of 4-byte items."""

    device = "cpu"

    def __init__(self, num_blocks, block_items):
        self.shape = (num_blocks, block_items)

    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

    def element_size(self):
        return 4

    def is_contiguous(self):
        return True

    def __getitem__(self, i):
        return FakeTensor.__new__(FakeTensor)._row(self.shape[1])

    def _row(self, items):
        self.shape = (items,)
        return self


class FakeNative:
    """Records the calls a worker makes; events are fed by the test."""

    def __init__(self, settings, regions, block_bytes, rank):
        self.role = settings.role
        self.engine_id = settings.engine_id
        self.regions = regions
        self.block_bytes = block_bytes
        self.rank = rank
        self.accept_any = settings.role == "prefill"
        self.address = "127.0.0.1:45678" if settings.role == "prefill" else "127.0.0.1:45679"
        self.calls = []
        self.events = []
        self.polls = 0
        self.closed = False
        self.fail_next = None  # an exception for the next call

    def _call(self, *call):
        self.calls.append(call)
        if self.fail_next is not None:
            e, self.fail_next = self.fail_next, None
            raise e

    def request_finished(self, rid, blocks, params, num_tokens):
        self._call("request_finished", rid, blocks, dict(params), num_tokens)
        return self._answer(rid, blocks, params, num_tokens)

    def _answer(self, rid, blocks, params, num_tokens):
        host, _, port = self.address.rpartition(":")
        answer = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_port": int(port),
            "remote_request_id": rid,
            "tp_size": 1,
            "transfer_id": params.get("transfer_id"),
            "transfer_mode": params.get("transfer_mode", "push"),
            "remote_num_tokens": num_tokens,
        }
        if params.get("transfer_mode") == "pull":
            answer["remote_block_ids"] = [list(g) for g in blocks]
            answer["remote_blocks_expiry_time"] = 123.0
        return answer

    def prefill_started(self, rid, blocks, params, num_tokens):
        self._call("prefill_started", rid, blocks, dict(params), num_tokens)
        return self._answer(rid, blocks, params, num_tokens)

    def layers_ready(self, rid, ready):
        self._call("layers_ready", rid, ready)

    def request_allocated(self, rid, blocks, params, num_tokens):
        self._call("request_allocated", rid, blocks, dict(params), num_tokens)

    def decline_export(self, rid, params):
        self._call("decline_export", rid, dict(params))

    def abort(self, rid):
        self._call("abort", rid)

    def poll_events(self):
        self.polls += 1
        out, self.events = self.events, []
        return out

    def close(self):
        self.closed = True


class Rejected(Exception):
    pass


class Hooks(A.KvHandoffHooks):
    def __init__(self, role, extra=None, policy="fail"):
        kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        self.sched = _Part(A.Settings.from_config(kv_role, f"{role}-engine", extra, load_failure_policy=policy,
                                                  block_tokens=16), True)
        self.work = _Part(A.Settings.from_config(kv_role, f"{role}-engine", extra, load_failure_policy=policy,
                                                 block_tokens=16), False)
        self.work.register_kv_caches({"layers.0.attn": FakeTensor(64, 1024), "layers.1.attn": FakeTensor(64, 1024)})
        self.sched.set_xfer_handshake_metadata({0: self.work.get_handshake_metadata()})
        self.native = self.work.worker.native

    def step(self, out=None):
        """One engine step with the hooks in vLLM's order (``out``: the scheduler's output);
        returns the worker's results."""
        meta = self.sched.build_connector_meta(out if out is not None else SimpleNamespace())
        w = self.work
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)  # async loads start after the forward: same call either way
        for layer in ("layers.0.attn", "layers.1.attn"):
            w.wait_for_layer_load(layer)
            w.save_kv_layer(layer, None, None)
        w.wait_for_save()
        res = w.get_transfer_results(set())
        w.clear_connector_metadata()
        self.sched.update_connector_output(res)
        return res


class _Part(A.KvHandoffHooks):
    def __init__(self, settings, scheduler):
        self._init_hooks(settings, scheduler, rank=0, factory=FakeNative)


def req(rid, prompt_len, params, status=Status.WAITING, computed=0):
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        prompt_token_ids=list(range(prompt_len)),
        num_computed_tokens=computed,
        status=status,
    )


# ---------------------------------------------------------------------------------------------
# P
# ---------------------------------------------------------------------------------------------


def _p_finish(p, rid="p-1-deadbeef", prompt=40, mode=None, extra_params=None):
    params = {"do_remote_decode": True}
    if mode:
        params["transfer_mode"] = mode
    params.update(extra_params or {})
    r = req(rid, prompt, params)
    assert p.sched.get_num_new_matched_tokens(r, 0) == (0, False)
    p.sched.update_state_after_alloc(r, FakeBlocks([3, 4, 5]), 0)
    p.step()  # the prefill step
    r.num_computed_tokens = prompt
    r.status = Status.FINISHED_LENGTH_CAPPED
    return r, p.sched.request_finished(r, [3, 4, 5])


def test_p_returns_params_and_frees_only_after_blocks_free():
    p = Hooks("prefill")
    r, (delay, params) = _p_finish(p)
    assert delay is True
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-engine"
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 45678)
    assert params["remote_request_id"] == r.request_id
    assert params["transfer_id"] == r.request_id
    assert params["transfer_mode"] == "push" and "remote_block_ids" not in params
    assert p.sched.has_pending_push_work()
    res = p.step()
    calls = [c for c in p.native.calls if c[0] == "request_finished"]
    assert calls == [("request_finished", r.request_id, [[3, 4, 5]],
                      {"do_remote_decode": True, "transfer_id": r.request_id}, 40)]
    assert res.finished_sending == set()
    assert p.work.worker.mismatches == 0
    # Steps go on until the rank hands the blocks back.
    assert p.step().finished_sending == set() and p.sched.has_pending_push_work()
    p.native.events.append({"request_id": r.request_id, "kind": "blocks_free", "final": True, "released": None})
    assert p.step().finished_sending == {r.request_id}
    assert not p.sched.has_pending_push_work()
    assert p.step().finished_sending == set()


def test_p_router_transfer_id_and_pull():
    p = Hooks("prefill")
    r, (delay, params) = _p_finish(p, mode="pull", extra_params={"transfer_id": "tx-7"})
    assert delay is True
    assert params["transfer_id"] == "tx-7" and params["transfer_mode"] == "pull"
    assert params["remote_block_ids"] == [[3, 4, 5]]
    p.step()
    assert p.native.calls[-1][3]["transfer_mode"] == "pull"
    assert p.work.worker.mismatches == 0
    p.native.events.append({"request_id": r.request_id, "kind": "export_ended", "final": True})
    assert p.step().finished_sending == {r.request_id}


def test_p_mismatch_between_scheduler_and_rank_is_counted():
    p = Hooks("prefill")
    p.sched.scheduler.ranks[0] = A.Handshake("prefill-engine", "127.0.0.1", 1)  # a wrong port
    _p_finish(p)
    p.step()
    assert p.work.worker.mismatches == 1


def test_p_not_remote_decode_and_aborted_free_at_once():
    p = Hooks("prefill")
    plain = req("plain", 10, None, status=Status.FINISHED_LENGTH_CAPPED)
    assert p.sched.request_finished(plain, [1]) == (False, None)
    aborted = req("ab-1", 40, {"do_remote_decode": True}, status=Status.FINISHED_ABORTED)
    assert p.sched.request_finished(aborted, [3, 4]) == (False, None)
    p.step()
    assert p.native.calls == []
    assert not p.sched.has_pending_push_work()


def test_p_native_error_frees_the_blocks():
    p = Hooks("prefill")
    r, (delay, _) = _p_finish(p)
    p.native.fail_next = Rejected("duplicate request")
    assert p.step().finished_sending == {r.request_id}
    assert not p.sched.has_pending_push_work()


def test_p_fault_drop_aborts_after_handing_over():
    p = Hooks("prefill", extra={"fault": "drop"})
    r, _ = _p_finish(p)
    p.step()
    assert [c[0] for c in p.native.calls] == ["request_finished", "abort"]
    p.native.events.append({"request_id": r.request_id, "kind": "blocks_free", "final": True, "released": "aborted"})
    assert p.step().finished_sending == {r.request_id}


def test_p_fault_corrupt_overwrites_before_handing_over():
    try:
        import torch
    except ImportError:
        return _skip("torch is not installed")
    p = Hooks("prefill", extra={"fault": "corrupt"})
    layers = {"l0": torch.zeros(8, 2, 4, 8), "l1": torch.zeros(8, 2, 4, 8)}
    p.work.worker.register_kv_caches(layers)
    p.native = p.work.worker.native
    r, _ = _p_finish(p)
    p.step()
    for t in layers.values():
        assert t[3].abs().sum() > 0 and t[5].abs().sum() > 0
        assert t[0].abs().sum() == 0 and t[6].abs().sum() == 0
    assert p.native.calls[-1][0] == "request_finished"


# ---------------------------------------------------------------------------------------------
# P, layer-wise (extra config "layerwise": true)


def _new(rid, blocks, n):
    """The scheduler's output of a step that schedules new request ``rid`` for ``n`` tokens."""
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(list(blocks),))],
                           scheduled_cached_reqs=None, num_scheduled_tokens={rid: n}, finished_req_ids=set())


def _lw_request(p, rid="lw-1", prompt=40, blocks=(3, 4, 5), max_tokens=1, params=None):
    r = req(rid, prompt, params or {"do_remote_decode": True})
    r.sampling_params = SimpleNamespace(max_tokens=max_tokens)
    assert p.sched.get_num_new_matched_tokens(r, 0) == (0, False)
    p.sched.update_state_after_alloc(r, FakeBlocks(list(blocks)), 0)
    return r


def _finish(r, status=Status.FINISHED_LENGTH_CAPPED):
    r.num_computed_tokens = len(r.prompt_token_ids)
    r.status = status


def test_p_layerwise_starts_in_the_prefill_step_and_reports_each_layer():
    p = Hooks("prefill", extra={"layerwise": True})
    r = _lw_request(p)
    # The prefill step: a block allocated ahead (6) is not the prompt's (40 tokens: 3 blocks).
    p.step(_new(r.request_id, [3, 4, 5, 6], 40))
    params = {"do_remote_decode": True, "transfer_id": r.request_id}
    assert p.native.calls == [
        ("prefill_started", r.request_id, [[3, 4, 5]], params, 40),
        ("layers_ready", r.request_id, 1),
        ("layers_ready", r.request_id, 2),
    ]
    assert p.work.worker.mismatches == 0
    _finish(r)
    delay, answer = p.sched.request_finished(r, [3, 4, 5])
    assert delay is True
    whole = Hooks("prefill")
    _, (_, want) = _p_finish(whole, rid=r.request_id)
    assert answer == want  # the same answer as a whole-request handover
    assert p.sched.has_pending_push_work()
    # D got it: the blocks come back only through finished_sending; nothing else is called.
    p.native.events.append({"request_id": r.request_id, "kind": "blocks_free", "final": True, "released": None})
    assert p.step().finished_sending == {r.request_id}
    assert [c[0] for c in p.native.calls].count("request_finished") == 0
    assert not p.sched.has_pending_push_work()


def test_p_layerwise_blocks_free_before_the_scheduler_finished_is_held():
    """The rank hands the blocks back in the prefill step itself (D gave up at once): vLLM must
    not hear of it before request_finished delayed their free."""
    p = Hooks("prefill", extra={"layerwise": True})
    r = _lw_request(p)
    p.native.events.append({"request_id": r.request_id, "kind": "blocks_free", "final": True,
                            "released": "CancelledByPeer"})
    assert p.step(_new(r.request_id, [3, 4, 5], 40)).finished_sending == set()
    _finish(r)
    assert p.sched.request_finished(r, [3, 4, 5])[0] is True
    assert p.step().finished_sending == {r.request_id}
    assert not p.sched.has_pending_push_work()


def test_p_layerwise_chunked_prefill_starts_with_the_last_chunk():
    p = Hooks("prefill", extra={"layerwise": True})
    r = _lw_request(p, blocks=(3,))
    p.step(_new(r.request_id, [3], 16))
    assert p.native.calls == []
    r.num_computed_tokens = 16
    cached = SimpleNamespace(req_ids=[r.request_id], new_block_ids=[([4, 5],)], resumed_req_ids=set())
    p.step(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={r.request_id: 24}, finished_req_ids=set()))
    assert p.native.calls[0][:3] == ("prefill_started", r.request_id, [[3, 4, 5]])
    assert [c[0] for c in p.native.calls[1:]] == ["layers_ready", "layers_ready"]


def test_p_layerwise_aborted_after_its_start_waits_for_the_rank():
    p = Hooks("prefill", extra={"layerwise": True})
    r = _lw_request(p)
    p.step(_new(r.request_id, [3, 4, 5], 40))
    _finish(r, Status.FINISHED_ABORTED)
    assert p.sched.request_finished(r, [3, 4, 5]) == (True, None)  # held: parts may be reading
    assert p.step().finished_sending == set()
    assert p.native.calls[-1] == ("abort", r.request_id)
    p.native.events.append({"request_id": r.request_id, "kind": "blocks_free", "final": True, "released": "Aborted"})
    assert p.step().finished_sending == {r.request_id}


def test_p_layerwise_start_error_frees_after_the_scheduler_finished():
    p = Hooks("prefill", extra={"layerwise": True})
    r = _lw_request(p)
    p.native.fail_next = Rejected("duplicate request")
    assert p.step(_new(r.request_id, [3, 4, 5], 40)).finished_sending == set()
    assert [c[0] for c in p.native.calls] == ["prefill_started"]  # no layer reports
    _finish(r)
    assert p.sched.request_finished(r, [3, 4, 5])[0] is True
    assert p.step().finished_sending == {r.request_id}


def test_p_layerwise_reports_only_layers_done_in_order():
    """save_kv_layer out of the registration order: only the run from layer 0 is reported;
    wait_for_save reports the rest."""
    p = Hooks("prefill", extra={"layerwise": True})
    r = _lw_request(p)
    w = p.work
    w.bind_connector_metadata(p.sched.build_connector_meta(_new(r.request_id, [3, 4, 5], 40)))
    w.save_kv_layer("layers.1.attn", None, None)
    assert [c[0] for c in p.native.calls] == ["prefill_started"]
    w.save_kv_layer("other.layer", None, None)
    w.wait_for_save()
    assert p.native.calls[1:] == [("layers_ready", r.request_id, 2)]


def test_p_layerwise_only_for_push_prefill_legs():
    cases = [
        ({"layerwise": True}, {"do_remote_decode": True, "transfer_mode": "pull"}, 1),
        ({"layerwise": True}, {"do_remote_decode": True}, 16),  # not a one-token prefill leg
        ({"layerwise": False}, {"do_remote_decode": True}, 1),
        ({}, {"do_remote_decode": True}, 1),
    ]
    if importlib.util.find_spec("torch") is not None:  # the corrupt fault overwrites with torch
        cases.append(({"layerwise": True, "fault": "corrupt"}, {"do_remote_decode": True}, 1))
    for extra, params, max_tokens in cases:
        p = Hooks("prefill", extra=extra)
        if "fault" in extra:
            import torch

            p.work.worker.register_kv_caches({f"layers.{i}.attn": torch.zeros(8, 2, 4, 8) for i in range(2)})
            p.native = p.work.worker.native
        r = _lw_request(p, params=params, max_tokens=max_tokens)
        p.step(_new(r.request_id, [3, 4, 5], 40))
        assert p.native.calls == [], (extra, params, max_tokens)
        _finish(r)
        assert p.sched.request_finished(r, [3, 4, 5])[0] is True
        p.step()
        assert [c[0] for c in p.native.calls] == ["request_finished"], (extra, params)


def test_p_layerwise_settings():
    s = A.Settings.from_config("kv_producer", "e1", {"layerwise": True, "layerwise_parts": 4,
                                                     "layerwise_min_tokens": 0})
    assert s.layerwise is True
    assert s.native["layerwise_parts"] == 4 and s.native["layerwise_min_tokens"] == 0
    assert A.Settings.from_config("kv_producer", "e1", None).layerwise is False
    for bad in ("yes", 1, None):
        try:
            A.Settings.from_config("kv_producer", "e1", {"layerwise": bad})
        except ValueError as e:
            assert "layerwise" in str(e)
        else:
            raise AssertionError(f"layerwise={bad!r} accepted")


# ---------------------------------------------------------------------------------------------
# D
# ---------------------------------------------------------------------------------------------


def _p_answer(mode="push"):
    params = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-engine",
        "remote_host": "127.0.0.1", "remote_port": 45678, "remote_request_id": "p-1-deadbeef",
        "tp_size": 1, "transfer_id": "p-1-deadbeef", "transfer_mode": mode, "remote_num_tokens": 40,
    }
    if mode == "pull":
        params["remote_block_ids"] = [[3, 4, 5]]
    return params


def _d_alloc(d, rid="d-1-cafebabe", prompt=40, mode="push"):
    params = _p_answer(mode)
    r = req(rid, prompt, params)
    n, is_async = d.sched.get_num_new_matched_tokens(r, 0)
    assert (n, is_async) == (prompt, True)
    assert d.sched.get_num_new_matched_tokens(r, 0) == (prompt, True)  # side-effect free
    d.sched.update_state_after_alloc(r, FakeBlocks([7, 8, 9]), n)
    assert params["do_remote_prefill"] is False
    r.status = Status.WAITING_FOR_REMOTE_KVS
    return r


def test_d_loads_and_reports_finished_recving_after_blocks_ready():
    d = Hooks("decode")
    r = _d_alloc(d)
    res = d.step()
    assert d.native.calls[0][0] == "request_allocated"
    _, rid, blocks, params, n = d.native.calls[0]
    assert (rid, blocks, n) == (r.request_id, [[7, 8, 9]], 40)
    assert params["remote_engine_id"] == "prefill-engine" and params["do_remote_prefill"] is True
    assert res.finished_recving == set()
    d.native.events.append({"request_id": r.request_id, "kind": "blocks_ready", "final": True})
    res = d.step()
    assert res.finished_recving == {r.request_id} and res.failed_recving == set()
    # The request runs on D afterwards; it finishes without any call.
    r.status = Status.FINISHED_LENGTH_CAPPED
    assert d.sched.request_finished(r, [7, 8, 9, 10]) == (False, None)
    d.step()
    assert [c[0] for c in d.native.calls] == ["request_allocated"]


def test_d_no_remote_prefill_matches_nothing():
    d = Hooks("decode")
    assert d.sched.get_num_new_matched_tokens(req("x", 40, None), 0) == (0, False)
    assert d.sched.get_num_new_matched_tokens(req("y", 40, {"do_remote_prefill": False}), 0) == (0, False)
    r = req("z", 40, _p_answer())
    assert d.sched.get_num_new_matched_tokens(r, 40) == (0, False)
    assert d.sched.get_num_new_matched_tokens(r, 32) == (8, True)


def test_d_pull_imported():
    d = Hooks("decode")
    r = _d_alloc(d, mode="pull")
    d.step()
    assert d.native.calls[0][3]["remote_block_ids"] == [[3, 4, 5]]
    d.native.events.append({"request_id": r.request_id, "kind": "imported", "outcome": "loaded", "final": True})
    res = d.step()
    assert res.finished_recving == {r.request_id} and res.failed_recving == set()


def test_d_failed_load_is_reported_failed():
    d = Hooks("decode")
    r = _d_alloc(d)
    d.step()
    d.native.events.append({"request_id": r.request_id, "kind": "decode_fenced", "final": False, "reason": "p gone"})
    res = d.step()
    # The failure is told at once; the blocks stay held (not finished_recving) until the final event.
    assert res.finished_recving == set() and res.failed_recving == {r.request_id}
    assert d.step().failed_recving == set()
    # vLLM ("fail") ends the request now: the scheduler's abort must not reach the rank.
    r.status = Status.FINISHED_ERROR
    assert d.sched.request_finished(r, [7, 8, 9]) == (False, None)
    assert d.sched.has_pending_push_work()
    d.step()
    assert [c[0] for c in d.native.calls] == ["request_allocated"]
    d.native.events.append({"request_id": r.request_id, "kind": "failed", "final": True, "reason": "p gone"})
    res = d.step()
    assert res.finished_recving == {r.request_id} and res.failed_recving == {r.request_id}
    assert not d.sched.has_pending_push_work()


def test_d_import_failed_or_recompute_is_reported_failed():
    for outcome in ("failed", "recompute"):
        d = Hooks("decode", policy="recompute")
        r = _d_alloc(d, mode="pull")
        d.step()
        d.native.events.append({"request_id": r.request_id, "kind": "imported", "outcome": outcome,
                                "valid_tokens": 16, "final": True})
        res = d.step()
        assert res.finished_recving == {r.request_id} and res.failed_recving == {r.request_id}, outcome


def test_d_native_error_is_a_failed_receive():
    d = Hooks("decode")
    r = _d_alloc(d)
    d.native.fail_next = Rejected("invalid params")
    res = d.step()
    assert res.finished_recving == {r.request_id} and res.failed_recving == {r.request_id}


def test_d_abort_while_waiting_frees_after_final_event():
    d = Hooks("decode")
    r = _d_alloc(d)
    d.step()
    r.status = Status.FINISHED_ABORTED
    assert d.sched.request_finished(r, [7, 8, 9]) == (False, None)
    assert d.sched.has_pending_push_work()  # keeps stepping until the blocks are back
    res = d.step()
    assert d.native.calls[-1] == ("abort", r.request_id)
    assert res.finished_recving == set()
    d.native.events.append({"request_id": r.request_id, "kind": "failed", "final": True, "reason": "aborted"})
    res = d.step()
    assert res.finished_recving == {r.request_id}
    assert not d.sched.has_pending_push_work()


def test_d_abort_after_final_event_calls_nothing():
    d = Hooks("decode")
    r = _d_alloc(d)
    d.step()
    d.native.events.append({"request_id": r.request_id, "kind": "failed", "final": True})
    res = d.step()
    assert res.failed_recving == {r.request_id}
    # vLLM (fail policy) ends the request with FINISHED_ERROR before update_connector_output.
    r.status = Status.FINISHED_ERROR
    d.sched.request_finished(r, [7, 8, 9])
    d.step()
    assert [c[0] for c in d.native.calls] == ["request_allocated"]


def test_d_abort_before_allocation_lets_p_go():
    for mode, call in (("push", "request_allocated"), ("pull", "decline_export")):
        d = Hooks("decode")
        r = req("d-early", 40, _p_answer(mode), status=Status.FINISHED_ABORTED)
        assert d.sched.request_finished(r, []) == (False, None)
        assert r.kv_transfer_params["do_remote_prefill"] is False
        d.step()
        assert d.native.calls[0][0] == call and d.native.calls[0][1] == "d-early"
        if call == "request_allocated":
            assert d.native.calls[0][2] == [[]] and d.native.calls[0][4] == 0
            d.native.events.append({"request_id": "d-early", "kind": "blocks_ready", "final": True})
        res = d.step()
        assert res.finished_recving == set()  # vLLM freed it already: never reported


# ---------------------------------------------------------------------------------------------
# Both
# ---------------------------------------------------------------------------------------------


def test_no_work_costs_nothing():
    for role in ("prefill", "decode"):
        h = Hooks(role)
        for _ in range(3):
            res = h.step()
            assert (res.finished_sending, res.finished_recving, res.failed_recving) == (set(), set(), set())
        assert h.native.calls == [] and h.native.polls == 0
        assert h.work.wait_for_layer_load("layers.0.attn") is None
        assert h.work.save_kv_layer("layers.0.attn", object(), object()) is None
        assert not h.sched.has_pending_push_work()


def test_register_one_region_per_layer():
    h = Hooks("decode")
    w = h.work.worker
    assert len(h.native.regions) == 2 and h.native.block_bytes == 4096
    assert h.native.accept_any is False and Hooks("prefill").native.accept_any is True
    assert h.work.get_handshake_metadata() == A.Handshake("decode-engine", "127.0.0.1", 45679, 0)
    assert w.block_bytes == 4096


def test_connector_class_is_complete_when_vllm_is_installed():
    if not A.HAVE_VLLM:
        return _skip("vLLM is not installed")
    assert not getattr(A.KvHandoffConnector, "__abstractmethods__", None)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert issubclass(A.KvHandoffConnector, KVConnectorBase_V1)
    assert A.KvHandoffConnector.get_transfer_results is A.KvHandoffHooks.get_transfer_results


def test_settings():
    s = A.Settings.from_config("kv_producer", "e1", None)
    assert (s.role, s.transport, s.listen, s.engine_id) == ("prefill", "nixl", "127.0.0.1:0", "e1")
    assert s.static_address() is None
    s = A.Settings.from_config("kv_consumer", "e1", {"transport": "mem", "listen": "0.0.0.0:7000",
                                                     "engine_id": "d0", "lease_ms": "500"})
    assert (s.role, s.transport, s.engine_id) == ("decode", "mem", "d0")
    # Passed on as given (the native layer parses "500"); the adapter's handshake timeout as a
    # default beneath a settings file and the environment.
    assert s.native == {"lease_ms": "500", "defaults": {"handshake_timeout_ms": 30_000}}
    s2 = A.Settings.from_config("kv_producer", "e1", {"config_file": "/etc/kvhandoff.toml",
                                                      "integrity_digest": True,
                                                      "defaults": {"handshake_timeout_ms": 9}})
    assert s2.native == {"config_file": "/etc/kvhandoff.toml", "integrity_digest": True,
                         "defaults": {"handshake_timeout_ms": 9}}
    assert s.static_address() == ("0.0.0.0", 7000)
    bad_cases = [("kv_both", {}), ("kv_producer", {"fault": "nope"})]
    if not A.__name__.startswith("kvhandoff_standalone"):
        # The native connector's key list decides what is unknown; without the extension every
        # other key is passed on (and refused by the native connector when the rank starts).
        bad_cases.append(("kv_producer", {"read_span": 1}))
    for bad in bad_cases:
        try:
            A.Settings.from_config(bad[0], "e", bad[1])
        except ValueError:
            pass
        else:
            raise AssertionError(f"{bad} accepted")


def test_scheduler_without_handshake_uses_a_fixed_port_or_refuses():
    s = A.SchedulerSide(A.Settings.from_config("kv_producer", "e1", {"listen": "127.0.0.1:7100"}))
    r = req("r1", 20, {"do_remote_decode": True}, status=Status.FINISHED_STOPPED, computed=20)
    delay, params = s.request_finished(r, [1, 2])
    assert delay and (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 7100)
    s = A.SchedulerSide(A.Settings.from_config("kv_producer", "e1", None))
    assert s.request_finished(r, [1, 2]) == (False, None)  # logged; the blocks are freed at once
    assert not s.has_pending_work()


# ---------------------------------------------------------------------------------------------


class _Skip(Exception):
    pass


def _skip(why):
    try:
        import pytest
    except ImportError:
        raise _Skip(why) from None
    pytest.skip(why)


if __name__ == "__main__":
    failed = skipped = 0
    tests = [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_") and callable(f)]
    for name, fn in tests:
        try:
            fn()
            print(f"PASS {name}")
        except _Skip as e:
            skipped += 1
            print(f"SKIP {name}: {e}")
        except Exception as e:  # noqa: BLE001
            failed += 1
            import traceback

            traceback.print_exc()
            print(f"FAIL {name}: {e!r}")
    print(f"{len(tests) - failed - skipped} passed, {skipped} skipped, {failed} failed")
    sys.exit(1 if failed else 0)
