"""Point-to-point ops on gocomm: send/recv with tags, messages taken out of order by tag, recv
from any source (and the sender it reports), isend/irecv and batch_isend_irecv; on worlds of
2 to 4 ranks and on subgroups of a 4-rank world."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranklib import ALL_DTYPES, Checker, dname, gen

SPECS = [(2, None), (3, None), (4, None), (4, [1, 3]), (4, [0, 1, 2])]
SPEC_IDS = ["w2", "w3", "w4", "w4-sub13", "w4-sub012"]


def _start(rk, group, what, seed):
    gc = rk.group(group)
    where = f"world {rk.size}" + (f" subgroup {group}" if group else "")
    return gc, Checker(f"{what} on {where}", seed, rk.rank)


def check_send_recv(rk, seed, group):
    """Blocking send/recv between every ordered pair (float32, and every dtype between the first and
    last rank), each with its own tag; empty and 4 MiB messages too."""
    gc, ck = _start(rk, group, "send/recv", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    cases = [(a, b, torch.float32, (3, 7)) for a in range(n) for b in range(n) if a != b]
    cases += [(0, n - 1, dt, (11,)) for dt in ALL_DTYPES] + [(n - 1, 0, dt, (2, 2)) for dt in ALL_DTYPES]
    cases += [(0, n - 1, torch.float32, (0,)), (n - 1, 0, torch.float32, (1 << 20,))]
    for i, (a, b, dtype, shape) in enumerate(cases):
        tag = 1000 + i
        label = f"send {a}->{b} tag {tag} {dname(dtype)} {shape}"
        with ck.case(label):
            x = gen(seed, f"sr/{i}", a, shape, dtype)
            if me == a:
                ret = dist.send(x, dst=gc.glob(b), group=gc.pg, tag=tag)
                ck.expect(label + " send returns None", ret is None, repr(ret))
            elif me == b:
                t = gen(seed, f"junk/{i}", b, shape, dtype)
                src = dist.recv(t, src=gc.glob(a), group=gc.pg, tag=tag)
                ck.same(label, t, x)
                ck.expect(
                    label + " recv returns the sender",
                    src == gc.glob(a),
                    f"returned {src}",
                )
    return ck.done()


def check_tags_out_of_order(rk, seed, group):
    """The first rank isends tags 7, 8, 9; the last rank posts irecvs for 9, 8, 7 (and, in a second
    case, blocking recvs in that order): each recv gets the message with its tag. Both directions
    at once."""
    gc, ck = _start(rk, group, "tags out of order", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    sends = [(7, (3,)), (8, (5,)), (9, (7,))]
    for a, b in ((0, n - 1), (n - 1, 0)):
        label = f"tags out of order {a}->{b}"
        with ck.case(label):
            msgs = [gen(seed, f"ooo/{a}/{i}", a, shape, torch.float32) for i, (_, shape) in enumerate(sends)]
            if me == a:
                works = [
                    dist.isend(m, dst=gc.glob(b), group=gc.pg, tag=tag) for m, (tag, _) in zip(msgs, sends, strict=True)
                ]
                for w in works:
                    w.wait()
            elif me == b:
                got = {}
                works = []
                for i in reversed(range(len(sends))):
                    tag, shape = sends[i]
                    got[i] = torch.zeros(shape)
                    works.append(dist.irecv(got[i], src=gc.glob(a), group=gc.pg, tag=tag))
                for w in works:
                    w.wait()
                for i in range(len(sends)):
                    ck.same(f"{label}: message {i} (tag {sends[i][0]})", got[i], msgs[i])
        dist.barrier(group=gc.gloo)
    with ck.case("blocking recvs in reverse tag order"):
        a, b = 0, n - 1
        msgs = [torch.full((4,), float(10 * t)) for t in (1, 2, 3)]
        if me == a:
            works = [dist.isend(m, dst=gc.glob(b), group=gc.pg, tag=t) for m, t in zip(msgs, (1, 2, 3), strict=True)]
            for w in works:
                w.wait()
        elif me == b:
            for t in (3, 2, 1):
                buf = torch.zeros(4)
                dist.recv(buf, src=gc.glob(a), group=gc.pg, tag=t)
                ck.same(f"blocking recv tag {t}", buf, msgs[t - 1])
    return ck.done()


def check_same_tag_fifo(rk, seed, group):
    """Messages from one sender with one tag are received in the order they were sent (as with
    gloo, NCCL and MPI): the first rank isends 4 messages with tag 7, the last rank takes them with
    4 irecvs (posted in order) or 4 blocking recvs. 25 rounds of each, to catch races."""
    gc, ck = _start(rk, group, "same-tag FIFO", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    a, b = 0, n - 1
    bad = {"irecv": [], "recv": []}
    for it in range(50):
        mode = "irecv" if it % 2 else "recv"
        with ck.case(f"round {it} ({mode})"):
            if me == a:
                works = [dist.isend(torch.full((3,), float(i)), dst=gc.glob(b), group=gc.pg, tag=7) for i in range(4)]
                for w in works:
                    w.wait()
            elif me == b:
                bufs = [torch.full((3,), -1.0) for _ in range(4)]
                if mode == "irecv":
                    works = [dist.irecv(t, src=gc.glob(a), group=gc.pg, tag=7) for t in bufs]
                    for w in works:
                        w.wait()
                else:
                    for t in bufs:
                        dist.recv(t, src=gc.glob(a), group=gc.pg, tag=7)
                got = [t[0].item() for t in bufs]
                if got != [0.0, 1.0, 2.0, 3.0]:
                    bad[mode].append((it, got))
        dist.barrier(group=gc.gloo)
    for mode, rounds in bad.items():
        if rounds:
            ck.fail(
                f"4 isends with tag 7, taken by {mode}",
                f"out of send order in {len(rounds)} of 25 rounds, e.g. round {rounds[0][0]} got messages "
                f"{rounds[0][1]} (want [0.0, 1.0, 2.0, 3.0])",
            )
    return ck.done()


def check_recv_any_source(rk, seed, group):
    """The first rank receives from any source; the sender returned matches the payload. A message
    with another tag is not taken by an any-source recv of a different tag."""
    gc, ck = _start(rk, group, "recv any source", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    with ck.case("recv(src=None) from every other rank"):
        if me == 0:
            seen = []
            for _ in range(n - 1):
                t = torch.zeros(3, dtype=torch.int64)
                src = dist.recv(t, group=gc.pg, tag=5)
                ck.expect(
                    "sender is a global rank of another member",
                    src in gc.ranks[1:],
                    f"recv returned {src}",
                )
                ck.same(f"payload from {src}", t, torch.full((3,), src, dtype=torch.int64))
                seen.append(src)
            ck.expect(
                "every sender seen once",
                sorted(seen) == sorted(gc.ranks[1:]),
                f"senders {seen}",
            )
        else:
            dist.send(
                torch.full((3,), gc.glob(me), dtype=torch.int64),
                dst=gc.glob(0),
                group=gc.pg,
                tag=5,
            )
    dist.barrier(group=gc.gloo)
    with ck.case("irecv(src=None): source rank"):
        last = n - 1
        if me == 0:
            t = torch.zeros(2)
            w = dist.irecv(t, group=gc.pg, tag=6)
            w.wait()
            ck.expect(
                "irecv source rank (group rank)",
                w._source_rank() == last,
                f"_source_rank() = {w._source_rank()}",
            )
            ck.same("irecv any source payload", t, torch.tensor([1.5, float(last)]))
        elif me == last:
            dist.send(torch.tensor([1.5, float(last)]), dst=gc.glob(0), group=gc.pg, tag=6)
    dist.barrier(group=gc.gloo)
    with ck.case("any-source recv respects tags"):
        last = n - 1
        if me == last:
            w1 = dist.isend(torch.full((2,), 61.0), dst=gc.glob(0), group=gc.pg, tag=61)
            w2 = dist.isend(torch.full((2,), 62.0), dst=gc.glob(0), group=gc.pg, tag=62)
            w1.wait()
            w2.wait()
        elif me == 0:
            t62, t61 = torch.zeros(2), torch.zeros(2)
            s62 = dist.recv(t62, group=gc.pg, tag=62)
            s61 = dist.recv(t61, group=gc.pg, tag=61)
            ck.same("tag 62", t62, torch.full((2,), 62.0))
            ck.same("tag 61", t61, torch.full((2,), 61.0))
            ck.expect("senders", s61 == s62 == gc.glob(last), f"{s61}, {s62}")
    return ck.done()


def check_isend_irecv(rk, seed, group):
    """Ring exchange with isend/irecv (both directions), and batch_isend_irecv."""
    gc, ck = _start(rk, group, "isend/irecv", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    right, left = (me + 1) % n, (me - 1) % n
    for dtype in ALL_DTYPES:
        label = f"isend/irecv ring {dname(dtype)}"
        with ck.case(label):
            x = {r: gen(seed, f"ring/{dname(dtype)}", r, (6, 3), dtype) for r in range(n)}
            y = {r: gen(seed, f"ringb/{dname(dtype)}", r, (4,), dtype) for r in range(n)}
            from_left = torch.zeros_like(x[me])
            from_right = torch.zeros_like(y[me])
            works = [
                dist.irecv(from_left, src=gc.glob(left), group=gc.pg, tag=1),
                dist.irecv(from_right, src=gc.glob(right), group=gc.pg, tag=2),
                dist.isend(x[me], dst=gc.glob(right), group=gc.pg, tag=1),
                dist.isend(y[me], dst=gc.glob(left), group=gc.pg, tag=2),
            ]
            for w in works:
                w.wait()
                ck.expect(label + " is_completed after wait", w.is_completed())
            ck.same(label + " from left", from_left, x[left])
            ck.same(label + " from right", from_right, y[right])
    with ck.case("isend/irecv futures"):
        x = torch.full((5,), float(me))
        t = torch.zeros(5)
        fr = dist.irecv(t, src=gc.glob(left), group=gc.pg, tag=3).get_future()
        fs = dist.isend(x, dst=gc.glob(right), group=gc.pg, tag=3).get_future()
        fr.wait()
        fs.wait()
        ck.same("irecv future", t, torch.full((5,), float(left)))
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        label = f"batch_isend_irecv {dname(dtype)}"
        with ck.case(label):
            x = {r: gen(seed, f"batch/{dname(dtype)}", r, (9,), dtype) for r in range(n)}
            y = {r: gen(seed, f"batchb/{dname(dtype)}", r, (2, 2), dtype) for r in range(n)}
            from_left = torch.zeros_like(x[me])
            from_right = torch.zeros_like(y[me])
            ops = [
                dist.P2POp(dist.isend, x[me], gc.glob(right), group=gc.pg, tag=4),
                dist.P2POp(dist.irecv, from_left, gc.glob(left), group=gc.pg, tag=4),
                dist.P2POp(dist.isend, y[me], gc.glob(left), group=gc.pg, tag=5),
                dist.P2POp(dist.irecv, from_right, gc.glob(right), group=gc.pg, tag=5),
            ]
            reqs = dist.batch_isend_irecv(ops)
            ck.expect(label + " returns works", len(reqs) >= 1, f"{len(reqs)} works")
            for req in reqs:
                req.wait()
            ck.same(label + " from left", from_left, x[left])
            ck.same(label + " from right", from_right, y[right])
    return ck.done()


CHECKS = {
    "send_recv": check_send_recv,
    "tags_out_of_order": check_tags_out_of_order,
    "same_tag_fifo": check_same_tag_fifo,
    "recv_any_source": check_recv_any_source,
    "isend_irecv_batch": check_isend_irecv,
}


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("check", list(CHECKS))
def test_p2p(worlds, seed, spec, check):
    size, group = spec
    results = worlds.get(size).run(CHECKS[check], seed=seed, group=group)
    for r in group if group is not None else range(size):
        assert results[r] > 0, f"rank {r} ran no cases"


def check_send_to_self(rk, seed):
    """A 1-rank world has no peer: send/recv to itself are refused before anything is sent."""
    ck = Checker("p2p on a 1-rank world", seed, rk.rank)
    for label, call in [
        ("send to self", lambda: dist.send(torch.ones(2), dst=0)),
        ("recv from self", lambda: dist.recv(torch.ones(2), src=0)),
        ("pg.send to self", lambda: rk.world.pg.send([torch.ones(2)], 0, 0)),
        ("pg.recv from self", lambda: rk.world.pg.recv([torch.ones(2)], 0, 0)),
    ]:
        with ck.case(label):
            try:
                call()
                ck.fail(label, "no error")
            except (ValueError, RuntimeError) as e:
                ck.expect(label + " message", "rank" in str(e), str(e))
    with ck.case("all_reduce after"):
        t = torch.ones(3)
        dist.all_reduce(t)
        ck.same("all_reduce after", t, torch.ones(3))
    return ck.done()


def test_p2p_world1_refuses_self(worlds, seed):
    worlds.get(1).run(check_send_to_self, seed=seed)
