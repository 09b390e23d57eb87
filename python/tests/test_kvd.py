"""The kvd Python package against a real kvd (started by conftest.py)."""
import dataclasses
import gc
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import kvd
from kvd import _lib

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "llama_decode.py")

Q, H, D = 8, 2, 64

# Samples every key (K = 1, L = 64, c = 1: a key at 150 degrees from the
# query is missed with probability (5/6)^64 ~ 1e-5), so kvd's estimate is
# exact attention up to bf16 storage (~2e-3 relative).
NEAR_EXACT = kvd.Model("py-exact", layers=3, q_heads=Q, kv_heads=H, head_dim=D, K=1, L=64, c=1,
                       sink=4, window=64, dense_layers=(0,), seed=11, segment_tokens=1024,
                       seal_tokens=128, kv_dtype="bf16", estimator="magicpig")


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def kv(rng, n):
    # keys with a shared offset (what centering is for) and a scale that
    # gives peaked but not one-hot attention
    k = rng.standard_normal((H, n, D)).astype(np.float32) + 0.5
    v = rng.standard_normal((H, n, D)).astype(np.float32)
    return k, v


@pytest.fixture
def client(sock):
    with kvd.connect(sock, "py", "pytest") as c:
        c.profile(NEAR_EXACT)
        yield c


# ---- library lookup ------------------------------------------------------

def test_library_lookup_order(monkeypatch):
    monkeypatch.setenv("KVD_LIBKVCLIENT", "/some/where/libkvclient.so")
    assert _lib.candidates() == [("$KVD_LIBKVCLIENT", "/some/where/libkvclient.so")]
    monkeypatch.setenv("KVD_LIBKVCLIENT", "/some/dir")
    monkeypatch.setattr(os.path, "isdir", lambda p: p == "/some/dir")
    assert _lib.candidates()[0][1] == "/some/dir/libkvclient.so"
    monkeypatch.undo()
    monkeypatch.delenv("KVD_LIBKVCLIENT", raising=False)
    c = [p for _, p in _lib.candidates()]
    assert c[0] == os.path.join(os.path.dirname(kvd.__file__), "libkvclient.so")
    assert c[1].endswith(os.path.join("build", "libkvclient.so"))
    assert c[-1] == "libkvclient.so"
    assert os.path.exists(kvd.library_path())


# ---- every call ----------------------------------------------------------

def test_profile_round_trip(sock):
    with kvd.connect(sock, "py", "profile") as c:
        assert c.backend == "cpu"
        assert c.model is None
        with pytest.raises(ValueError, match="no profile"):
            c.sequence()
        m = c.profile(name="py-defaults", layers=2, q_heads=Q, kv_heads=H, head_dim=D)
        # the client's defaults: kvd's recommended configuration
        assert (m.K, m.L, m.c, m.sink, m.window) == (10, 70, 2, 4, 64)
        assert (m.kv_dtype, m.estimator) == ("int8", "hybrid_lcv")
        assert m.segment_tokens > 0 and m.seal_tokens > 0      # kvd's defaults
        assert c.model is m and m.group == Q // H
        w = c.w
        assert w.shape == (D, 10 * 70) and w.dtype == np.float32
        assert np.isfinite(w).all() and abs(float(w.std()) - 1) < 0.05
        with pytest.raises(kvd.KvdError, match="already has a profile") as e:
            c.profile(m)
        assert e.value.name == "EALREADY"
        # the same profile from another connection: the same W
        with kvd.connect(sock, "py", "profile2") as c2:
            assert c2.profile(m) == m
            assert np.array_equal(c2.w, w)
        c.nop()
        st = c.server_stats()
        assert st.clients >= 1 and st.profiles >= 1
        assert c.timing().attends == 0      # CPU backend: zeros


def test_sequence_round_trip(client, sock):
    rng = np.random.default_rng(1)
    n = 700
    before = client.server_stats().sequences
    s = client.sequence()
    assert s.id != 0 and not s.freed
    assert client.server_stats().sequences == before + 1
    ks, vs = [], []
    for layer in range(3):
        k, v = kv(rng, n)
        s.prefill(layer, k, v)
        ks.append(k)
        vs.append(v)
    assert s.tokens(1) == n
    assert s.kvd_range(0) == (0, 0)                 # dense: all here
    assert s.kvd_range(1) == (4, n - 64)
    st = s.stats()
    assert st.tokens == n - 4 - 64 and st.state == "ram" and st.bytes > 0 and st.segments >= 1
    q = rng.standard_normal((Q, D)).astype(np.float32)
    for layer in range(3):
        o, lse = s.attend(layer, q)
        assert o.shape == (Q, D) and lse.shape == (Q,) and o.dtype == np.float32
        assert np.isfinite(o).all() and np.isfinite(lse).all()
    o, lse = s.attend_kvd(1, q)
    assert o.shape == (Q, D) and np.isfinite(lse).all()
    k1 = rng.standard_normal((H, D)).astype(np.float32)
    for layer in range(3):
        s.append(layer, k1, k1)
    assert s.tokens(2) == n + 1
    s.free()
    assert s.freed
    s.free()                                        # idempotent
    assert client.server_stats().sequences == before
    with pytest.raises(ValueError, match="freed"):
        s.attend(1, q)


def test_attend_near_exact_vs_numpy(client):
    """A batch of sequences of different lengths, every layer, against
    dense attention over all tokens in float64."""
    rng = np.random.default_rng(2)
    lens = [40, 600, 1500]          # the first is all sinks + window: kvd holds nothing
    seqs, data = [], []
    for n in lens:
        s = client.sequence()
        d = [kv(rng, n) for _ in range(3)]
        for layer, (k, v) in enumerate(d):
            s.prefill(layer, k, v)
        seqs.append(s)
        data.append(d)
    q = rng.standard_normal((len(lens), Q, D)).astype(np.float32)
    for layer in range(3):
        o, lse = client.attend(layer, seqs, q, centered=False)
        ok, lk = client.attend_kvd(layer, seqs, q, centered=False) if layer else (None, None)
        for i in range(len(lens)):
            k, v = data[i][layer]
            ro, rl = kvd.attend_exact(q[i], k, v)
            assert rel(o[i], ro) < 1e-2, (layer, i, rel(o[i], ro))
            assert np.abs(lse[i] - rl).max() < 1e-2
            if layer == 0:
                continue
            # kvd's part alone against the same positions, and the merge of
            # it with an exact local part equals the whole
            a, b = seqs[i].kvd_range(layer)
            if b == a:
                assert np.isneginf(lk[i]).all() and not ok[i].any()
                continue
            po, pl = kvd.attend_exact(q[i], k[:, a:b], v[:, a:b])
            assert rel(ok[i], po) < 1e-2 and np.abs(lk[i] - pl).max() < 1e-2
            loc = np.r_[0:a, b:lens[i]]
            lo_, ll_ = kvd.attend_exact(q[i], k[:, loc], v[:, loc])
            mo, ml = kvd.merge(lo_, ll_, ok[i], lk[i])
            assert rel(mo, ro) < 1e-2 and np.abs(ml - rl).max() < 1e-2
        # centered lse = raw lse - q·m/√d
        oc, lc = client.attend(layer, seqs, q)
        assert np.array_equal(oc, o)
        for i, s in enumerate(seqs):
            assert np.allclose(lc[i] + s.lse_shift(layer, q[i]), lse[i], atol=1e-4)
    for s in seqs:
        s.free()


def test_appends_reach_kvd(client):
    """Decoding past the window: the mirror of what kvd holds equals kvd's
    own count after every step, and attention stays near exact."""
    rng = np.random.default_rng(3)
    n0, steps = 300, 150
    k, v = kv(rng, n0 + steps)
    with client.sequence() as s:
        for layer in range(3):
            s.prefill(layer, k[:, :n0], v[:, :n0])
        for t in range(n0, n0 + steps):
            for layer in range(3):
                s.append(layer, k[:, t], v[:, t])
            a, b = s.kvd_range(1)
            assert a == 4 and s.stats().tokens == b - a, t
            assert 64 <= t + 1 - b < 64 + kvd.APPEND_BATCH
        q = rng.standard_normal((Q, D)).astype(np.float32)
        ro, rl = kvd.attend_exact(q, k, v)
        for layer in range(3):
            o, lse = s.attend(layer, q, centered=False)
            assert rel(o, ro) < 1e-2 and np.abs(lse - rl).max() < 1e-2
    assert s.freed


def test_int8_profile(sock):
    """kv_dtype="int8": kvd stores sealed K/V as int8.  The profile says so
    when read back, kvd's part stays near exact attention (quantization
    costs a little), and it is not the bf16 profile's answer to the same
    rows: the option took effect.  Bad values are refused."""
    rng = np.random.default_rng(9)
    n0, steps = 1500, 300                           # two prompt segments, two tail seals
    k, v = kv(rng, n0 + steps)
    q = rng.standard_normal((Q, D)).astype(np.float32)
    m8 = dataclasses.replace(NEAR_EXACT, name="py-exact-int8", kv_dtype="int8")
    out = {}
    for m in (NEAR_EXACT, m8):
        with kvd.connect(sock, "py", "dtype-" + m.kv_dtype) as c:
            got = c.profile(m)
            assert got.kv_dtype == m.kv_dtype and got == m
            with c.sequence() as s:
                for layer in range(3):
                    s.prefill(layer, k[:, :n0], v[:, :n0])
                for t in range(n0, n0 + steps):
                    for layer in range(3):
                        s.append(layer, k[:, t], v[:, t])
                a, b = s.kvd_range(1)
                st = s.stats()
                assert st.tokens == b - a and st.segments == (2 + 2) * 2     # layers 1, 2
                o, lse = s.attend_kvd(1, q, centered=False)
                po, pl = kvd.attend_exact(q, k[:, a:b], v[:, a:b])
                out[m.kv_dtype] = (o, lse, rel(o, po), np.abs(lse - pl).max())
    (o16, l16, e16, le16), (o8, l8, e8, le8) = out["bf16"], out["int8"]
    assert e16 < 1e-2 and le16 < 1e-2
    assert e8 < 3e-2 and le8 < 3e-2, (e8, le8)
    assert not np.array_equal(o8, o16)
    with kvd.connect(sock, "py", "dtype-hold") as h, kvd.connect(sock, "py", "dtype-bad") as c:
        h.profile(m8)                               # a profile lives while someone holds it
        # the int8 profile's name with other storage is another profile
        with pytest.raises(kvd.KvdError, match="exists with other fields") as e:
            c.profile(dataclasses.replace(m8, kv_dtype="bf16"))
        assert e.value.name == "EEXIST"
        with pytest.raises(kvd.KvdError, match="kv_dtype 7") as e:
            c.profile(dataclasses.replace(m8, name="py-bad-dtype", kv_dtype=7))
        assert e.value.name == "EINVAL"
        with pytest.raises(ValueError, match="kv_dtype: 'fp8' is not one of bf16, int8"):
            c.profile(dataclasses.replace(m8, kv_dtype="fp8"))
        assert c.profile(m8).kv_dtype == "int8"    # the connection is still good


def test_estimator_profile(sock):
    """estimator="hybrid": kvd makes the profile with it (read back), keeps
    a small state per sparse layer of a sequence once attended (its bytes
    show in the sequence's, q_heads * (1 + 32) * 4 per layer; magicpig keeps
    none) and answers finite.  The numbers are the engine's business: this
    is the plumbing.  Bad values are refused."""
    rng = np.random.default_rng(13)
    n0, steps = 1500, 200
    k, v = kv(rng, n0 + steps)
    q = rng.standard_normal((Q, D)).astype(np.float32)
    mh = dataclasses.replace(NEAR_EXACT, name="py-exact-hybrid", estimator="hybrid")
    hb = Q * (1 + 32) * 4
    for m in (NEAR_EXACT, mh):
        with kvd.connect(sock, "py", "est-" + m.estimator) as c:
            got = c.profile(m)
            assert got.estimator == m.estimator and got == m
            with c.sequence() as s:
                for layer in range(3):
                    s.prefill(layer, k[:, :n0], v[:, :n0])
                b0 = s.stats().bytes
                for _ in range(2):                  # made once, then used
                    for layer in (1, 2):
                        o, lse = s.attend_kvd(layer, q, centered=False)
                        assert np.isfinite(o).all() and np.isfinite(lse).all()
                    assert s.stats().bytes - b0 == (2 * hb if m is mh else 0)
                for t in range(n0, n0 + steps):
                    for layer in range(3):
                        s.append(layer, k[:, t], v[:, t])
                    if t % 50 == 0:
                        for layer in (1, 2):
                            o, lse = s.attend_kvd(layer, q, centered=False)
                            assert np.isfinite(o).all() and np.isfinite(lse).all()
    with kvd.connect(sock, "py", "est-hold") as h, kvd.connect(sock, "py", "est-bad") as c:
        h.profile(mh)                               # a profile lives while someone holds it
        # the hybrid profile's name with another estimator is another profile
        with pytest.raises(kvd.KvdError, match="exists with other fields") as e:
            c.profile(dataclasses.replace(mh, estimator="magicpig"))
        assert e.value.name == "EEXIST"
        with pytest.raises(kvd.KvdError, match="estimator 7") as e:
            c.profile(dataclasses.replace(mh, name="py-bad-est", estimator=7))
        assert e.value.name == "EINVAL"
        with pytest.raises(ValueError,
                           match="estimator: 'exact' is not one of magicpig, hybrid, adaptive, hybrid_cv, hybrid_lcv"):
            c.profile(dataclasses.replace(mh, estimator="exact"))
        assert c.profile(mh).estimator == "hybrid"  # the connection is still good
        assert kvd.ESTIMATORS == {"magicpig": 0, "hybrid": 1, "adaptive": 2,
                                  "hybrid_cv": 3, "hybrid_lcv": 4}


# ---- the merge -----------------------------------------------------------

def test_merge_math():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((3, Q, D))
    k = rng.standard_normal((H, 50, D))
    v = rng.standard_normal((H, 50, D))
    ro, rl = kvd.attend_exact(q, k, v)
    # by hand: softmax over all keys
    s = np.einsum("bhd,hnd->bhn", q, np.repeat(k, Q // H, axis=0)) / math.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert np.allclose(ro, np.einsum("bhn,hnd->bhd", p, np.repeat(v, Q // H, axis=0)))
    assert np.allclose(rl, np.log(np.exp(s).sum(-1)))
    # any split merges back to the whole, in either order
    for cut in (0, 1, 17, 50):
        a = kvd.attend_exact(q, k[:, :cut], v[:, :cut])
        b = kvd.attend_exact(q, k[:, cut:], v[:, cut:])
        for x, y in ((a, b), (b, a)):
            o, lse = kvd.merge(*x, *y)
            assert np.allclose(o, ro, atol=1e-12) and np.allclose(lse, rl, atol=1e-12)
    # float32 in, float32 out; both empty -> (0, -inf)
    o32, l32 = kvd.merge(ro.astype(np.float32), rl.astype(np.float32),
                         np.zeros_like(ro, np.float32), np.full(rl.shape, -np.inf, np.float32))
    assert o32.dtype == np.float32 and np.allclose(o32, ro, atol=1e-6)
    z, zl = kvd.merge(np.zeros((2, 4)), np.full(2, -np.inf), np.ones((2, 4)), np.full(2, -np.inf))
    assert not z.any() and np.isneginf(zl).all()
    # large lse values do not overflow
    o, lse = kvd.merge(np.ones((1, 2)), np.array([1000.0]), np.zeros((1, 2)), np.array([1000.0]))
    assert np.allclose(o, 0.5) and np.isclose(lse[0], 1000 + math.log(2))
    with pytest.raises(ValueError):
        kvd.merge(np.zeros((2, 4)), np.zeros(3), np.zeros((2, 4)), np.zeros(3))


# ---- errors --------------------------------------------------------------

def test_errors_carry_kvds_message(client, sock, tmp_path):
    with pytest.raises(kvd.KvdError) as e:
        client.open_sequence(12345)
    assert e.value.message == "kvd: no sequence 12345" and e.value.name == "ENOENT"
    assert e.value.code == -2 and "no sequence 12345" in str(e.value)
    assert client.last_error() == "kvd: no sequence 12345"
    with kvd.connect(sock, "py", "bad") as c:
        with pytest.raises(kvd.KvdError, match="head_dim 17 is not a multiple of 16") as e:
            c.profile(name="bad", layers=1, q_heads=4, kv_heads=2, head_dim=17)
        assert e.value.name == "KVD_EGEOM"
        with pytest.raises(kvd.KvdError, match="kv_heads 3 does not divide"):
            c.profile(name="bad", layers=1, q_heads=4, kv_heads=3, head_dim=16)
    with pytest.raises(kvd.KvdError, match="connect .*nosuch.sock") as e:
        kvd.connect(str(tmp_path / "nosuch.sock"))
    assert e.value.op == "kvc_connect" and e.value.name == "ENOENT"

    rng = np.random.default_rng(5)
    k, v = kv(rng, 200)
    q = np.zeros((Q, D), np.float32)
    with client.sequence() as s:
        with pytest.raises(kvd.KvdError, match="not prefilled"):
            s.attend(1, q)
        s.prefill(1, k, v)
        with pytest.raises(kvd.KvdError, match="layer 1 already prefilled"):
            s.prefill(1, k, v)
        with pytest.raises(kvd.KvdError, match="append before prefill"):
            s.append(2, k[:, 0], v[:, 0])
        s.prefill(0, k, v)
        with pytest.raises(kvd.KvdError, match="dense: kvd holds nothing"):
            s.attend_kvd(0, q)
        # checked here, before C sees them
        with pytest.raises(TypeError, match="float32"):
            s.prefill(2, k.astype(np.float64), v)
        with pytest.raises(ValueError, match=r"shape \(2, 200, 32\), expected \(2, n, 64\)"):
            s.prefill(2, k[..., :32], v[..., :32])
        with pytest.raises(ValueError, match="differ in shape"):
            s.prefill(2, k, v[:, :100])
        with pytest.raises(ValueError, match="out of range"):
            s.prefill(3, k, v)
        with pytest.raises(ValueError, match="q: shape"):
            s.attend(1, q[:4])
        with pytest.raises(ValueError, match="q: shape"):
            client.attend(1, [s, s], q)
        # non-contiguous float32 is fine: copied
        s.prefill(2, np.asfortranarray(k), v[:, ::1])
        o, _ = s.attend(2, np.asfortranarray(q))
        assert np.isfinite(o).all()


def test_closed_and_collected(sock):
    with kvd.connect(sock, "py", "watch") as w:
        base = w.server_stats().sequences
        c = kvd.connect(sock, "py", "life")
        c.profile(NEAR_EXACT)
        s1, s2 = c.sequence(), c.sequence()
        assert w.server_stats().sequences == base + 2
        del s1
        gc.collect()                                # __del__ frees it in kvd
        assert w.server_stats().sequences == base + 1
        c.close()
        assert c.closed and s2.freed                # close frees what is left
        c.close()
        with pytest.raises(ValueError, match="closed"):
            c.sequence()
        with pytest.raises(ValueError, match="closed|freed"):
            s2.stats()
        assert w.server_stats().sequences == base
        # a sequence keeps its client alive; dropping both cleans up
        c = kvd.connect(sock, "py", "gc")
        c.profile(NEAR_EXACT)
        s = c.sequence()
        del c
        gc.collect()
        assert not s.freed and w.server_stats().sequences == base + 1
        del s
        gc.collect()
        deadline = time.monotonic() + 5
        while w.server_stats().clients > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = w.server_stats()
        assert st.sequences == base and st.clients == 1


def test_spill_evict_prefetch_and_reopen(tmp_path):
    """evict, prefetch and open_sequence need kvd's spill tier: a daemon of
    their own with --spill-dir and --persist, restarted in the middle."""
    spill = str(tmp_path / "spill")
    os.mkdir(spill)
    rng = np.random.default_rng(6)
    data = [kv(rng, 900) for _ in range(3)]
    q = rng.standard_normal((Q, D)).astype(np.float32)
    with kvd.Daemon(args=["--spill-dir", spill, "--persist"]) as d:
        c = kvd.connect(d.socket, "py", "spill")
        c.profile(NEAR_EXACT)
        s = c.sequence()
        for layer, (k, v) in enumerate(data):
            s.prefill(layer, k, v)
        want = [s.attend_kvd(layer, q) for layer in (1, 2)]
        s.evict()
        deadline = time.monotonic() + 30
        while (st := s.stats()).state == "spilling" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st.state == "disk" and st.durable and st.disk_bytes > 0
        s.prefetch()
        for layer, (o, lse) in zip((1, 2), want):  # bit for bit after the round trip
            o2, l2 = s.attend_kvd(layer, q)
            assert np.array_equal(o, o2) and np.array_equal(lse, l2)
        s.evict()
        while s.stats().state == "spilling" and time.monotonic() < deadline:
            time.sleep(0.01)
        sid, tokens = s.id, s.stats().tokens
        assert d.stop() == 0                        # the file stays (--persist)
        c.close()                                   # kvd is gone: frees our side only
    with kvd.Daemon(args=["--spill-dir", spill, "--persist"]) as d:
        with kvd.connect(d.socket, "py", "spill2") as c:
            c.profile(NEAR_EXACT)
            s, n = c.open_sequence(sid)
            assert n == tokens and s.reopened
            for layer, (o, lse) in zip((1, 2), want):
                o2, l2 = s.attend_kvd(layer, q)
                assert np.array_equal(o, o2) and np.array_equal(lse, l2)
            with pytest.raises(kvd.KvdError, match="reopened"):
                s.append(1, data[1][0][:, 0], data[1][1][:, 0])
            with pytest.raises(ValueError, match="reopened"):
                s.kvd_range(1)
            s.free()
        assert d.stop() == 0


# ---- torch ---------------------------------------------------------------

def test_torch_helper(client):
    torch = pytest.importorskip("torch")
    import kvd.torch as kt

    g = torch.Generator().manual_seed(7)
    n = 800
    seqs, caches = [], []
    for _ in range(2):
        s = client.sequence()
        k = torch.randn(3, H, n, D, generator=g) + 0.5
        v = torch.randn(3, H, n, D, generator=g)
        for layer in range(3):
            kt.prefill(s, layer, k[layer], v[layer])
        seqs.append(s)
        caches.append((k, v))
    # a few decoded tokens, given as bf16 (converted to float32 on the way)
    for t in range(40):
        for i, s in enumerate(seqs):
            k1 = torch.randn(3, H, 1, D, generator=g)
            v1 = torch.randn(3, H, 1, D, generator=g)
            for layer in range(3):
                kt.append(s, layer, k1[layer, :, 0].bfloat16(), v1[layer, :, 0].bfloat16())
            k, v = caches[i]
            caches[i] = (torch.cat([k, k1.bfloat16().float()], 2),
                         torch.cat([v, v1.bfloat16().float()], 2))
    q = torch.randn(2, Q, D, generator=g)
    for layer in range(3):
        ks = [c[0][layer] for c in caches]
        vs = [c[1][layer] for c in caches]
        o, lse = kt.attend_split(client, layer, seqs, q, ks, vs)
        ao, al = kt.attend(client, layer, seqs, q, centered=False)
        assert o.dtype == torch.float32 and o.shape == (2, Q, D) and lse.shape == (2, Q)
        for i in range(2):
            ro, rl = kt.attend_exact(q[i].double(), ks[i].double(), vs[i].double())
            assert rel(o[i], ro.numpy()) < 1e-2 and (lse[i] - rl).abs().max() < 1e-2
            assert rel(ao[i], ro.numpy()) < 1e-2 and (al[i] - rl).abs().max() < 1e-2
            # the torch helpers agree with numpy's
            no, nl = kvd.attend_exact(q[i].numpy(), ks[i].numpy(), vs[i].numpy())
            assert np.allclose(ro.numpy(), no) and np.allclose(rl.numpy(), nl)
        ko, kl = kt.attend_kvd(client, layer, [seqs[0]], q[:1]) if layer else (None, None)
        if layer:
            assert ko.shape == (1, Q, D)
    # torch merge == numpy merge, empty parts included
    a = (torch.randn(4, D, generator=g), torch.tensor([0.5, -math.inf, 3.0, -math.inf]))
    b = (torch.randn(4, D, generator=g), torch.tensor([1.5, 2.0, -math.inf, -math.inf]))
    mo, ml = kt.merge(*a, *b)
    no, nl = kvd.merge(a[0].numpy(), a[1].numpy(), b[0].numpy(), b[1].numpy())
    assert np.allclose(mo.numpy(), no, atol=1e-6) and np.allclose(ml.numpy(), nl)
    assert torch.isneginf(ml[3]) and not mo[3].any()
    with pytest.raises(TypeError):
        kt.prefill(seqs[0], 1, torch.zeros(H, 4, D, dtype=torch.int32), torch.zeros(H, 4, D))
    for s in seqs:
        s.free()


# ---- the example ---------------------------------------------------------

def test_example_llama_decode(sock):
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, EXAMPLE, "--socket", sock, "--ctx", "384", "--mlp", "512", "--steps",
                        "40", "--check"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)))
    sys.stdout.write(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "near-exact" in r.stdout and "magicpig" in r.stdout


# ---- the MagicPIG profile against the estimator in numpy ------------------

def test_magicpig_equals_numpy_estimator(sock):
    """K=10, L=150, c=2: kvd's part equals kvd.reference.estimate (the
    estimator of docs/ARCHITECTURE.md recomputed in numpy from W, the
    centered bf16 keys and their codes), up to float rounding."""
    from kvd import reference
    rng = np.random.default_rng(8)
    with kvd.connect(sock, "py", "magicpig") as c:
        m = c.profile(name="py-magicpig", layers=2, q_heads=Q, kv_heads=H, head_dim=D, K=10,
                      L=150, c=2, dense_layers=(0,), seed=3, segment_tokens=1024,
                      kv_dtype="bf16", estimator="magicpig")
        w = c.w
        for n in (600, 2500):                       # one segment; three
            k, v = kv(rng, n)
            q = rng.standard_normal((Q, D)).astype(np.float32) * 2
            q[0] = k[0, n // 2] * 1.5                # a needle kvd must find
            with c.sequence() as s:
                s.prefill(1, k, v)
                a, b = s.kvd_range(1)
                o, lse = s.attend_kvd(1, q)
                ro, rl, frac = reference.estimate(q, k[:, a:b], v[:, a:b], s.mean(1), w,
                                                  m.K, m.L, m.c)
                assert 0 < frac.mean() < 0.2
                assert rel(o, ro) < 1e-4 and np.abs(lse - rl).max() < 1e-4, (rel(o, ro), n)
                # the needle dominates head 0: close to exact even when sampled
                xo, _ = kvd.attend_exact(q, k[:, a:b] - s.mean(1)[:, None], v[:, a:b])
                assert rel(o[0], xo[0]) < 0.05


def test_fork(client):
    """Sequence.fork(): the child answers exactly what its parent answers,
    then each continues on its own tokens and answers exactly what a
    sequence given the same tokens privately answers; freeing the parent
    first leaves the child whole."""
    rng = np.random.default_rng(21)
    n0, steps = 1200, 200
    k, v = kv(rng, n0 + 2 * steps)
    ka, va = k[:, :n0 + steps], v[:, :n0 + steps]
    kb = np.concatenate([k[:, :n0], k[:, n0 + steps:]], axis=1)
    vb = np.concatenate([v[:, :n0], v[:, n0 + steps:]], axis=1)
    q = rng.standard_normal((Q, D)).astype(np.float32)

    def build(kk, vv):
        s = client.sequence()
        for layer in range(3):
            s.prefill(layer, kk[:, :n0], vv[:, :n0])
        for t in range(n0, kk.shape[1]):
            for layer in range(3):
                s.append(layer, kk[:, t], vv[:, t])
        return s

    parent = build(k[:, :n0], v[:, :n0])
    child = parent.fork()
    for layer in range(3):
        po, pl = parent.attend(layer, q, centered=False)
        co, cl = child.attend(layer, q, centered=False)
        assert np.array_equal(po, co) and np.array_equal(pl, cl)
    for t in range(steps):
        for layer in range(3):
            parent.append(layer, ka[:, n0 + t], va[:, n0 + t])
            child.append(layer, kb[:, n0 + t], vb[:, n0 + t])
    with build(ka, va) as pa, build(kb, vb) as pb:
        for layer in range(3):
            want_a, want_b = pa.attend(layer, q, centered=False), pb.attend(layer, q, centered=False)
            got_a, got_b = parent.attend(layer, q, centered=False), child.attend(layer, q, centered=False)
            assert all(np.array_equal(x, y) for x, y in zip(got_a, want_a)), layer
            assert all(np.array_equal(x, y) for x, y in zip(got_b, want_b)), layer
        assert not np.array_equal(got_a[0], got_b[0])
    parent.free()
    o2, l2 = child.attend(2, q, centered=False)
    assert np.array_equal(o2, got_b[0]) and np.array_equal(l2, got_b[1])
    child.free()


def test_publish_attach(sock):
    """Client.attach / Sequence.publish: a prompt published on one connection
    is attached on another (every chunk named by its content key); the
    attached sequence answers exactly what its publisher answers, and both
    extended by the same tokens still do, as a private sequence given the
    same calls does; a prompt nobody published is a miss (0 tokens)."""
    rng = np.random.default_rng(31)
    n0, more = 1024, 300                            # 8 chunks of 128
    k, v = kv(rng, n0 + more)
    ids = np.arange(n0 + more, dtype=np.uint32) * 7 + 1
    q = rng.standard_normal((Q, D)).astype(np.float32)
    with kvd.connect(sock, "py", "publisher") as a, kvd.connect(sock, "py2", "attacher") as b:
        a.profile(NEAR_EXACT)
        b.profile(NEAR_EXACT)
        assert a.chunk_tokens() == 128
        assert len(a.content_keys(ids[:n0])) == n0 // 128
        assert a.content_keys(ids[:n0]) == b.content_keys(ids[:n0])
        s = a.sequence()
        for layer in range(3):
            s.extend(layer, k[:, :n0], v[:, :n0])
        with pytest.raises(ValueError):
            s.publish(ids[:n0 - 5])
        s.publish(ids[:n0])
        x, got = b.attach(ids)
        assert got == n0 and x.tokens(1) == n0
        assert x.kvd_range(1) == s.kvd_range(1)
        assert np.array_equal(x.mean(1), s.mean(1))
        for layer in range(3):
            want, have = s.attend(layer, q, centered=False), x.attend(layer, q, centered=False)
            assert all(np.array_equal(p, r) for p, r in zip(want, have)), layer
        for layer in range(3):
            s.extend(layer, k[:, n0:], v[:, n0:])
            x.extend(layer, k[:, n0:], v[:, n0:])
        with a.sequence() as p:
            for layer in range(3):
                p.extend(layer, k[:, :n0], v[:, :n0])
                p.extend(layer, k[:, n0:], v[:, n0:])
            for layer in range(3):
                want = p.attend(layer, q, centered=False)
                for got_seq in (s, x):
                    have = got_seq.attend(layer, q, centered=False)
                    assert all(np.array_equal(w, h) for w, h in zip(want, have)), layer
        y, got = b.attach(ids[::-1].copy())
        assert got == 0 and y.tokens(1) == 0
        y.free()
        x.free()
        s.free()
