"""Transports: the in-process fake (faults on demand), the compatibility handshake, two processes
over gloo on 127.0.0.1, and a NIXL loopback when ``nixl`` imports.

The gloo test runs this file as a script in two subprocesses (``--worker RANK PORT OUT``) under a
watchdog (``subprocess`` timeouts: pytest-timeout is not installed), so a hang fails the test
instead of stalling the suite.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from flash_dllm.distributed.segment_allocator import SegmentAllocator
from flash_dllm.distributed.fake_transport import FakeNetwork
from flash_dllm.distributed.transport import (USER_TAG_LIMIT, Compat,
                                              IncompatiblePeerError, TransferCancelled,
                                              TransferError, TransferTimeout, check_compat,
                                              compat_hash)

COMPAT = Compat("llada-8b", "bfloat16", 16, "page-first", "dual", (("kv_heads", 32),))


def _segment(seed: int = 0, shape=(4, 4, 2, 16, 4, 64)) -> torch.Tensor:
    """A random page-first segment (pages, layers, 2, page_size, kv_heads, head_dim), bf16."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


# ------------------------------------------------------------------------------------- fake
def test_fake_completes_after_n_polls_and_copies_bytes():
    t0, t1 = FakeNetwork.pair(polls_to_complete=3)
    seg = _segment()
    nbytes = seg.numel() * seg.element_size()
    staging = torch.zeros(nbytes + 512, dtype=torch.uint8)
    hr = t1.recv(0, staging[256:256 + nbytes], tag=5)
    assert not t1.poll(hr) and not t1.poll(hr)          # unmatched: polls do not count
    hs = t0.send(1, seg, tag=5)
    assert [t1.poll(hr), t1.poll(hr), t0.poll(hs)] == [False, False, True]
    assert t1.poll(hr) and hr.done and t0.settled(hs) and t1.settled(hr)
    assert torch.equal(staging[256:256 + nbytes].view(torch.bfloat16).view(seg.shape), seg)
    assert staging[:256].eq(0).all() and staging[256 + nbytes:].eq(0).all()


def test_fake_matches_per_tag_in_posting_order():
    net = FakeNetwork(3)
    a, b, c = (net.endpoint(r) for r in range(3))
    outs = [torch.zeros(2) for _ in range(3)]
    hr = [c.recv(0, outs[0], 1), c.recv(0, outs[1], 1), c.recv(1, outs[2], 1)]
    hs = [a.send(2, torch.tensor([1.0, 1.0]), 1), a.send(2, torch.tensor([2.0, 2.0]), 1),
          b.send(2, torch.tensor([3.0, 3.0]), 1)]
    for h in hr:
        c.wait(h, timeout_s=1.0)
    assert [o[0].item() for o in outs] == [1.0, 2.0, 3.0] and all(a.poll(h) for h in hs[:2])


def test_fake_failure_on_demand():
    net = FakeNetwork(2, polls_to_complete=2)
    t0, t1 = net.endpoint(0), net.endpoint(1)
    net.fail_next(1)
    out = torch.zeros(4)
    hs, hr = t0.send(1, torch.ones(4), 1), t1.recv(0, out, 1)
    assert not t1.poll(hr)
    with pytest.raises(TransferError, match="recv of tag 1 from rank 0 .*injected failure"):
        t1.wait(hr, timeout_s=1.0)
    with pytest.raises(TransferError, match="injected failure"):
        t0.poll(hs)
    with pytest.raises(TransferError):
        t1.poll(hr)                                     # stays failed
    assert out.eq(0).all() and t1.settled(hr) and hr.state == "failed"
    # the switch was for one transfer; a per-tag switch fails every transfer with that tag
    net.fail_tag(9)
    hs, hr = t0.send(1, torch.ones(4), 2), t1.recv(0, out, 2)
    t1.wait(hr, 1.0)
    t0.wait(hs, 1.0)
    for _ in range(2):
        hs, hr = t0.send(1, torch.ones(4), 9), t1.recv(0, out, 9)
        with pytest.raises(TransferError):
            t1.wait(hr, 1.0)
    # a size mismatch fails both sides, as gloo does
    hs, hr = t0.send(1, torch.ones(3), 3), t1.recv(0, out, 3)
    with pytest.raises(TransferError, match="size mismatch: sender 12 bytes, receiver 16"):
        t0.wait(hs, 1.0)


def test_fake_hang_times_out_within_the_deadline_then_cancel():
    net = FakeNetwork(2)
    t0, t1 = net.endpoint(0), net.endpoint(1)
    net.hang_tag(4)
    hs, hr = t0.send(1, torch.ones(4), 4), t1.recv(0, torch.zeros(4), 4)
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"recv of tag 4 from rank 0 \(16 bytes\) not done "
                                              r"after 0.2 s") as exc:
        t1.wait(hr, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - start < 1.0
    assert exc.value.handle is hr and hr.state == "pending"   # the caller decides: cancel it
    t1.cancel(hr)
    t1.cancel(hr)                                             # idempotent
    assert t1.settled(hr)
    with pytest.raises(TransferCancelled):
        t1.poll(hr)
    with pytest.raises(TransferError, match="rank 1 cancelled it"):
        t0.poll(hs)


def test_fake_cancel_before_match_withdraws_the_receive():
    t0, t1 = FakeNetwork.pair()
    first, second = torch.zeros(2), torch.zeros(2)
    h1 = t1.recv(0, first, 7)
    t1.cancel(h1)
    h2 = t1.recv(0, second, 7)
    hs = t0.send(1, torch.tensor([5.0, 6.0]), 7)
    t1.wait(h2, 1.0)
    assert t0.poll(hs) and first.eq(0).all() and second.tolist() == [5.0, 6.0]
    t0.cancel(hs)                                             # no-op once done
    assert hs.done


def test_transport_argument_errors_name_the_argument():
    t0, t1 = FakeNetwork.pair()
    with pytest.raises(ValueError, match=r"dst_rank must be a rank in \[0, 2\) other than this "
                                         r"one \(0\), got 0"):
        t0.send(0, torch.ones(2), 1)
    with pytest.raises(ValueError, match="src_rank must be a rank"):
        t1.recv(5, torch.ones(2), 1)
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        t0.send(1, torch.ones(4, 4).t(), 1)
    with pytest.raises(ValueError, match="out_tensor must be a torch.Tensor"):
        t1.recv(0, [1, 2], 1)
    with pytest.raises(ValueError, match=f"tag must be an integer in \\[0, {USER_TAG_LIMIT}\\)"):
        t0.send(1, torch.ones(2), USER_TAG_LIMIT)              # reserved for the handshake
    h = t0.send(1, torch.ones(2), 1)
    for bad in (0, -1, float("inf"), True):
        with pytest.raises(ValueError, match="timeout_s must be a finite number > 0"):
            t0.wait(h, bad)
    with pytest.raises(ValueError, match="handle must be a TransferHandle of this transport"):
        t1.poll(h)
    with pytest.raises(ValueError, match="polls_to_complete must be an integer >= 1"):
        FakeNetwork(2, polls_to_complete=0)


# -------------------------------------------------------------------------------- handshake
def _both(a, b, fa, fb):
    """Run ``a.handshake(1, fa)`` in a thread and ``b.handshake(0, fb)`` here; both outcomes."""
    out = {}

    def run_a():
        try:
            out["a"] = a.handshake(1, fa, timeout_s=5.0)
        except Exception as e:  # noqa: BLE001
            out["a"] = e

    th = threading.Thread(target=run_a)
    th.start()
    try:
        out["b"] = b.handshake(0, fb, timeout_s=5.0)
    except Exception as e:  # noqa: BLE001
        out["b"] = e
    th.join(10)
    return out["a"], out["b"]


def test_compat_hash_and_fields():
    h = compat_hash("llada-8b", "bfloat16", 16, "page-first", "dual", kv_heads=32)
    assert h == COMPAT.digest and len(h) == 32
    assert h != compat_hash("llada-8b", "bfloat16", 32, "page-first", "dual", kv_heads=32)
    assert h != compat_hash("llada-8b", "bfloat16", 16, "page-first", "dual")
    assert COMPAT.fields()["version"] == 1
    with pytest.raises(ValueError, match="page_size must be an integer >= 1, got 0"):
        Compat("m", "bf16", 0, "page-first", "dual")
    with pytest.raises(ValueError, match="dtype must be a non-empty string"):
        Compat("m", "", 16, "page-first", "dual")
    with pytest.raises(ValueError, match="extra names must be unique and not a base field"):
        Compat("m", "bf16", 16, "page-first", "dual", (("dtype", "x"),))


def test_handshake_match_and_mismatch_over_fake():
    a, b = FakeNetwork.pair()
    ra, rb = _both(a, b, COMPAT, COMPAT)
    assert ra == rb == COMPAT.fields()
    other = Compat("llada-8b", "float16", 32, "page-first", "dual", (("kv_heads", 32),))
    ra, rb = _both(a, b, COMPAT, other)
    assert isinstance(ra, IncompatiblePeerError) and isinstance(rb, IncompatiblePeerError)
    assert str(ra) == ("peer rank 1 is incompatible: dtype: local 'bfloat16', peer 'float16'; "
                       "page_size: local 16, peer 32")
    assert str(rb).startswith("peer rank 0 is incompatible: dtype: local 'float16'")
    # a field only one side has is named too
    ra, _ = _both(a, b, COMPAT, Compat("llada-8b", "bfloat16", 16, "page-first", "dual"))
    assert "kv_heads: local 32, peer '<unset>'" in str(ra)


def test_handshake_garbage_and_silence():
    with pytest.raises(IncompatiblePeerError, match="unreadable handshake"):
        check_compat(COMPAT, b"\xffnot json", peer=3)
    forged = json.dumps({"fields": {**COMPAT.fields(), "page_size": 32},
                         "hash": COMPAT.digest.hex()}).encode()
    with pytest.raises(IncompatiblePeerError, match="hash does not match its fields"):
        check_compat(COMPAT, forged, peer=3)
    a, _ = FakeNetwork.pair()
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        a.handshake(1, COMPAT, timeout_s=0.2)                 # the peer never answers
    assert time.monotonic() - start < 1.0


def test_torch_transport_needs_a_process_group():
    from flash_dllm.distributed.torch_transport import TorchDistTransport
    if torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchDistTransport()


# -------------------------------------------------------------------------- gloo, 2 processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str) -> None:
    """One rank of the gloo scenario; rank 0 sends, rank 1 receives and reports."""
    import datetime

    import torch.distributed as dist

    from flash_dllm.distributed.torch_transport import (TorchDistTransport, recv_fragments,
                                                  send_fragments)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=30))
    tr = TorchDistTransport()
    peer, res = 1 - rank, {}
    res["fields"] = tr.handshake(peer, COMPAT, timeout_s=20.0)
    theirs = COMPAT if rank == 0 else Compat("llada-8b", "bfloat16", 32, "page-first", "dual",
                                             (("kv_heads", 32),))
    try:
        tr.handshake(peer, theirs, timeout_s=20.0)
    except IncompatiblePeerError as e:
        res["mismatch"] = str(e)

    seg = _segment(seed=1)
    nbytes = seg.numel() * seg.element_size()
    if rank == 0:
        tr.wait(tr.send(1, seg, 11), timeout_s=20.0)          # the segment
        tr.wait(tr.send(1, seg[0], 13), timeout_s=20.0)       # after the receiver's timeout
        tr.wait(tr.send(1, seg[1], 12), timeout_s=20.0)       # the late send for tag 12
        for batched in (True, False):
            for w in send_fragments(seg, 1, batched=batched, tag_base=100):
                w.wait()
    else:
        alloc = SegmentAllocator(1 << 20, align=256)
        alloc.alloc(1000)                                     # the segment lands at an offset
        staging = torch.zeros(1 << 20, dtype=torch.uint8)
        off = alloc.alloc(nbytes)
        view = staging[off:off + nbytes]
        tr.wait(tr.recv(0, view, 11), timeout_s=20.0)
        res["offset"] = off
        res["exact"] = torch.equal(view.view(torch.bfloat16).view(seg.shape), seg)
        res["outside_untouched"] = bool(staging[:off].eq(0).all()
                                        and staging[off + nbytes:].eq(0).all())
        alloc.free(off)
        # A receive whose sender does not send: a clean timeout, not a hang.
        off2 = alloc.alloc(nbytes // 4)
        late = staging[off2:off2 + nbytes // 4]
        h = tr.recv(0, late, 12)
        start = time.monotonic()
        try:
            tr.wait(h, timeout_s=1.0)
        except TransferTimeout as e:
            res["timeout_s"] = time.monotonic() - start
            res["timeout_msg"] = str(e)
        tr.cancel(h)
        res["settled_after_cancel"] = tr.settled(h)
        # The group still works for other tags.
        got = torch.empty_like(seg[0])
        tr.wait(tr.recv(0, got, 13), timeout_s=20.0)
        res["other_tag_ok"] = torch.equal(got, seg[0])
        # The late send still lands in the cancelled buffer: why it is held until settled.
        deadline = time.monotonic() + 20.0
        while not tr.settled(h) and time.monotonic() < deadline:
            time.sleep(0.01)
        res["settled_late"] = tr.settled(h)
        res["late_data_landed"] = torch.equal(late.view(torch.bfloat16).view(seg[1].shape),
                                              seg[1])
        alloc.free(off2)
        res["frag_exact"] = []
        for batched in (True, False):
            kv = torch.zeros_like(seg)
            for w in recv_fragments(kv, 0, batched=batched, tag_base=100):
                w.wait()
            res["frag_exact"].append(torch.equal(kv, seg))
    dist.barrier()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(res))


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo")
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME":
           os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(port),
                               str(tmp / f"rank{r}.json")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    deadline = time.monotonic() + 120.0                       # the watchdog
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1.0))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("gloo workers hung past the 120 s watchdog")
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-3000:]}"
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_gloo_handshake(gloo_run):
    r0, r1 = gloo_run
    assert r0["fields"] == r1["fields"] == COMPAT.fields()
    assert r0["mismatch"] == "peer rank 1 is incompatible: page_size: local 16, peer 32"
    assert r1["mismatch"] == "peer rank 0 is incompatible: page_size: local 32, peer 16"


def test_gloo_segment_into_staging_slice_is_bit_exact(gloo_run):
    r1 = gloo_run[1]
    assert r1["offset"] == 1024                               # 1000 rounded up to align 256
    assert r1["exact"] and r1["outside_untouched"]
    assert r1["frag_exact"] == [True, True]


def test_gloo_receive_without_sender_times_out_cleanly(gloo_run):
    r1 = gloo_run[1]
    assert 1.0 <= r1["timeout_s"] < 3.0
    assert "recv of tag 12 from rank 0" in r1["timeout_msg"]
    assert "gloo cannot cancel" in r1["timeout_msg"]
    assert r1["settled_after_cancel"] is False                # the irecv is still posted
    assert r1["other_tag_ok"] and r1["settled_late"] and r1["late_data_landed"]


# ------------------------------------------------------------------------------------- NIXL
def test_nixl_loopback():
    pytest.importorskip("nixl", reason="nixl does not import here")
    from flash_dllm.distributed.nixl_transport import NixlTransport
    a, b = NixlTransport(0, 2), NixlTransport(1, 2)
    try:
        staging = torch.zeros(1 << 20, dtype=torch.uint8)
        b.register(staging)                                  # before the metadata goes out
        a.add_peer(1, b.metadata())
        b.add_peer(0, a.metadata())
        ra, rb = _both(a, b, COMPAT, COMPAT)
        assert ra == rb == COMPAT.fields()
        seg = _segment(seed=2)
        nbytes = seg.numel() * seg.element_size()
        hr = b.recv(0, staging[4096:4096 + nbytes], 3)
        hs = a.send(1, seg, 3)
        deadline = time.monotonic() + 20.0
        while not (a.poll(hs) and b.poll(hr)):
            assert time.monotonic() < deadline, "NIXL loopback transfer did not finish"
        assert torch.equal(staging[4096:4096 + nbytes].view(torch.bfloat16).view(seg.shape), seg)
        # the receiver cancels before the sender posts: the send fails, the receive settles
        hr = b.recv(0, staging[:1024], 4)
        b.cancel(hr)
        hs = a.send(1, seg.view(-1)[:512], 4)
        with pytest.raises(TransferError, match="the receiver cancelled it"):
            a.wait(hs, timeout_s=10.0)
        deadline = time.monotonic() + 10.0
        while not b.settled(hr):
            assert time.monotonic() < deadline
        with pytest.raises(ValueError, match="out_tensor must lie in a registered buffer"):
            b.recv(0, torch.zeros(16, dtype=torch.uint8), 5)
        hr = b.recv(0, staging[:64], 6)
        with pytest.raises(TransferTimeout):
            b.wait(hr, timeout_s=0.2)                         # nobody sends
    finally:
        a.close()
        b.close()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
