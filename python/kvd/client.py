"""The kvc_* API of libkvclient over ctypes, with numpy arrays in and out."""
import ctypes
import math
import threading
import weakref
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence as _Seq, Tuple

import numpy as np

from . import _lib
from .errors import KvdError

# Tokens leaving the window go to kvd this many at a time: libkvclient's rule
# (APPEND_BATCH in kvc.c, KVG_APPEND_BATCH on the CUDA backend).  Sequence
# mirrors it to say which positions kvd holds; the tests check the mirror
# against kvd's own count.
APPEND_BATCH = 32

BACKENDS = {"cpu": 0, "cuda": 1, "auto": 2}
# Model.kv_dtype: how kvd stores sealed K/V (enum kvc_kv_dtype).
KV_DTYPES = {"bf16": 0, "int8": 1}
# Model.estimator: how kvd estimates attention over sealed segments
# (enum kvc_estimator).
ESTIMATORS = {"magicpig": 0, "hybrid": 1, "adaptive": 2, "hybrid_cv": 3, "hybrid_lcv": 4}
SEQ_STATES = ("ram", "spilling", "disk", "restoring", "lost")


@dataclass(frozen=True)
class Model:
    """A model profile (struct kvc_model).  Zero segment_tokens/seal_tokens:
    kvd's defaults, 32768 and 1024 (read them back from ``Client.model``);
    segment_tokens defaults to the recommended 65536.  kv_dtype: how
    kvd stores the K/V rows of sealed segments, "int8" (the default) or
    "bf16" (what is sent is the same either way; int8 takes about half the
    memory and is approximate).  estimator: how kvd estimates attention over
    sealed segments, "hybrid_lcv" (the default), "magicpig", "hybrid",
    "adaptive" or "hybrid_cv" (all but magicpig keep a small state per
    sequence and layer in kvd)."""
    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    # K, L, c, kv_dtype, estimator and segment_tokens default to kvd's
    # recommended configuration (KVD_EST_CFG_DEFAULT, engine/attn.h):
    # MagicPIG K10 L150 bf16's accuracy for about 0.3 of its CPU.  MagicPIG's own is
    # K=10, L=150, kv_dtype="bf16", estimator="magicpig".
    K: int = 10                 # bits per table
    L: int = 70                 # tables
    c: int = 2                  # collisions needed (1 or 2)
    sink: int = 4               # tokens kept by the client at the start
    window: int = 64            # recent tokens kept by the client
    dense_layers: Tuple[int, ...] = ()
    seed: int = 0               # of the projection matrix W
    segment_tokens: int = 65536
    seal_tokens: int = 0
    kv_dtype: str = "int8"
    estimator: str = "hybrid_lcv"

    @property
    def group(self):
        return self.q_heads // self.kv_heads


@dataclass
class ServerStats:
    """kvc_server_stats (docs/PROTOCOL.md, ServerStats)."""
    clients: int = 0
    sequences: int = 0
    profiles: int = 0
    slots_in_use: int = 0
    bytes: int = 0
    requests: int = 0
    errors: int = 0
    disconnects: int = 0
    mapped_bytes: int = 0
    mem_limit: int = 0
    mem_high: int = 0
    mem_low: int = 0
    reserved_bytes: int = 0
    disk_bytes: int = 0
    on_disk: int = 0
    spills: int = 0
    restores: int = 0
    drops: int = 0
    spill_errors: int = 0
    lost: int = 0
    spill_bytes: int = 0
    restore_bytes: int = 0
    used_bytes: int = 0
    refused: int = 0


@dataclass
class SeqStats:
    """kvc_seq_stats: tokens kvd holds per layer, bytes, segments, tier state."""
    tokens: int = 0
    bytes: int = 0
    segments: int = 0
    state: str = "ram"
    durable: bool = False
    disk_bytes: int = 0
    ready_layers: int = 0


@dataclass
class Timing:
    """kvc_timing (CUDA backend; zeros on the CPU one)."""
    attends: int = 0
    appends: int = 0
    evicted: int = 0
    prefills: int = 0
    kvd_wait_ms: float = 0.0
    gpu_wait_ms: float = 0.0
    evict_ms: float = 0.0
    prefill_ms: float = 0.0
    hash_ms: float = 0.0
    window_ms: float = 0.0
    h2d_ms: float = 0.0
    merge_ms: float = 0.0


def _dtype_name(v):
    for k, n in KV_DTYPES.items():
        if n == v:
            return k
    return v


def _est_name(v):
    for k, n in ESTIMATORS.items():
        if n == v:
            return k
    return v


def _enum(field, v, names):
    """A name of `names` as its number; an int goes as it is (kvd judges it)."""
    if isinstance(v, str):
        if v not in names:
            raise ValueError("%s: %r is not one of %s" % (field, v, ", ".join(names)))
        return names[v]
    return v


def _from_struct(cls, st):
    return cls(**{f.name: getattr(st, f.name) for f in fields(cls)})


def _f32(x, what, shape):
    """x as a C-contiguous float32 ndarray of `shape` (None: any size there),
    or TypeError/ValueError naming `what`."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError("%s: dtype %s, libkvclient takes float32 (use .astype(np.float32))"
                        % (what, x.dtype))
    if x.ndim != len(shape) or any(w is not None and w != g for w, g in zip(shape, x.shape)):
        raise ValueError("%s: shape %s, expected %s" % (
            what, tuple(x.shape), "(" + ", ".join("n" if w is None else str(w) for w in shape)
            + ("," if len(shape) == 1 else "") + ")"))
    return np.ascontiguousarray(x)


def _ptr(a):
    return ctypes.c_void_p(a.ctypes.data)


@dataclass
class _Layer:
    """What kvd holds of one layer of one sequence, mirrored from kvc's rules."""
    n: int = 0                  # tokens so far
    start: int = 0              # kvd holds positions [start, end)
    end: int = 0
    mean: Optional[np.ndarray] = None   # [kv_heads][d] centering mean; None: dense


class Client:
    """One connection to kvd (struct kvc).  Use as a context manager, or call
    close(); a Client that is garbage-collected closes itself.

    A Client is safe to share between threads (calls are serialised)."""

    def __init__(self, socket_path=None, tenant=None, name=None, *, poll=False, slots=0,
                 slot_size=0, spin_ns=0, backend="cpu", device=0, max_batch=0, timing=False):
        self._h = None
        self._lock = threading.RLock()
        self._seqs = weakref.WeakValueDictionary()
        self._model = None
        if backend not in BACKENDS:
            raise ValueError("backend %r: one of %s" % (backend, ", ".join(BACKENDS)))
        self._lib = _lib.load()
        enc = lambda s: None if s is None else str(s).encode()  # noqa: E731
        self._keep = (enc(socket_path), enc(tenant), enc(name))
        o = _lib.KvcOpts(socket_path=self._keep[0], tenant=self._keep[1], name=self._keep[2],
                         poll=int(bool(poll)), slots=slots, slot_size=slot_size, spin_ns=spin_ns,
                         backend=BACKENDS[backend], device=device, max_batch=max_batch,
                         timing=int(bool(timing)))
        h = ctypes.c_void_p()
        rc = self._lib.kvc_connect(ctypes.byref(o), ctypes.byref(h))
        if rc < 0:
            msg = self._lib.kvc_last_error(h) if h else b""
            self._lib.kvc_close(h)
            raise KvdError("kvc_connect", rc, (msg or b"").decode(errors="replace"))
        self._h = h

    # ---- lifetime ----
    def close(self):
        """Frees every sequence still open (in kvd and here) and disconnects.
        Idempotent."""
        with self._lock:
            if self._h is None:
                return
            for s in list(self._seqs.values()):
                try:
                    s.free()
                except Exception:
                    pass
            self._lib.kvc_close(self._h)
            self._h = None

    @property
    def closed(self):
        return self._h is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _handle(self):
        if self._h is None:
            raise ValueError("operation on a closed kvd client")
        return self._h

    def _call(self, fname, *args):
        rc = getattr(self._lib, fname)(self._handle(), *args)
        if rc < 0:
            raise KvdError(fname, rc, self.last_error())
        return rc

    def last_error(self):
        """kvc_last_error(): the reason for the last failure."""
        if self._h is None:
            return ""
        return (self._lib.kvc_last_error(self._h) or b"").decode(errors="replace")

    # ---- profile ----
    @property
    def backend(self):
        """'cpu' or 'cuda': what this connection runs on."""
        with self._lock:
            return "cuda" if self._lib.kvc_backend(self._handle()) == 1 else "cpu"

    def profile(self, model=None, **kw):
        """Creates the profile (or opens kvd's with the same fields): a Model,
        or Model's fields as keywords.  Once per connection, before any
        sequence.  Returns the profile as kvd filled it in."""
        if model is None:
            model = Model(**kw)
        elif kw:
            raise TypeError("profile(): a Model or keywords, not both")
        dt = _enum("kv_dtype", model.kv_dtype, KV_DTYPES)
        est = _enum("estimator", model.estimator, ESTIMATORS)
        dense = (ctypes.c_uint32 * max(1, len(model.dense_layers)))(*model.dense_layers)
        name = model.name.encode()
        m = _lib.KvcModel(name=name, layers=model.layers, q_heads=model.q_heads,
                          kv_heads=model.kv_heads, head_dim=model.head_dim, K=model.K, L=model.L,
                          c=model.c, sink=model.sink, window=model.window,
                          dense_layers=ctypes.cast(dense, _lib.c_u32_p),
                          n_dense=len(model.dense_layers), seed=model.seed,
                          segment_tokens=model.segment_tokens, seal_tokens=model.seal_tokens,
                          kv_dtype=dt, estimator=est)
        with self._lock:
            self._call("kvc_profile", ctypes.byref(m))
            return self.model

    @property
    def model(self):
        """The profile as kvd filled it in (kvc_model_of), or None before profile()."""
        with self._lock:
            if self._model is None:
                p = self._lib.kvc_model_of(self._handle())
                if not p:
                    return None
                m = p.contents
                self._model = Model(
                    name=m.name.decode(), layers=m.layers, q_heads=m.q_heads,
                    kv_heads=m.kv_heads, head_dim=m.head_dim, K=m.K, L=m.L, c=m.c, sink=m.sink,
                    window=m.window, dense_layers=tuple(m.dense_layers[i] for i in range(m.n_dense)),
                    seed=m.seed, segment_tokens=m.segment_tokens, seal_tokens=m.seal_tokens,
                    kv_dtype=_dtype_name(m.kv_dtype), estimator=_est_name(m.estimator))
            return self._model

    def _need_model(self):
        m = self.model
        if m is None:
            raise ValueError("no profile yet: call Client.profile() first")
        return m

    @property
    def w(self):
        """W, the SimHash projection matrix: a copy, float32 [head_dim][K*L]."""
        with self._lock:
            m = self._need_model()
            p = self._lib.kvc_w(self._handle())
            return np.ctypeslib.as_array(p, shape=(m.head_dim, m.K * m.L)).copy()

    # ---- sequences ----
    def sequence(self):
        """A new sequence (kvc_seq_create)."""
        with self._lock:
            self._need_model()
            h = ctypes.c_void_p()
            self._call("kvc_seq_create", ctypes.byref(h))
            return Sequence(self, h)

    def open_sequence(self, seq_id):
        """Takes over a sequence nobody owns (kvd --persist, after a restart;
        kvc_seq_open).  Returns (Sequence, tokens kvd holds per layer).  Its
        local part did not survive: attend answers from kvd alone, append
        is refused."""
        with self._lock:
            self._need_model()
            h = ctypes.c_void_p()
            tokens = ctypes.c_uint64()
            self._call("kvc_seq_open", ctypes.c_uint64(seq_id), ctypes.byref(h),
                       ctypes.byref(tokens))
            return Sequence(self, h, reopened=True), tokens.value

    # ---- prefix sharing (docs/PROTOCOL.md "Prefix sharing") ----
    def chunk_tokens(self):
        """Tokens per content-key chunk of the profile (kvc_chunk_tokens)."""
        with self._lock:
            self._need_model()
            return self._lib.kvc_chunk_tokens(self._handle())

    def content_keys(self, token_ids):
        """The content keys of the whole chunks of token_ids (kvc_content_keys):
        a list of 16-byte bytes, key i naming chunks 0..i."""
        ids = np.ascontiguousarray(np.asarray(token_ids, dtype=np.uint32).ravel())
        with self._lock:
            self._need_model()
            chunk = self._lib.kvc_chunk_tokens(self._handle())
            buf = ctypes.create_string_buffer(max(1, len(ids) // max(chunk, 1)) * 16)
            n = self._call("kvc_content_keys",
                           ids.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)),
                           len(ids), buf)
        return [buf.raw[16 * i:16 * (i + 1)] for i in range(n)]

    def attach(self, token_ids):
        """A new sequence holding the longest published prefix of token_ids
        (kvc_seq_attach).  Returns (Sequence, tokens attached): 0 tokens is an
        empty sequence to prefill.  Continue it with Sequence.extend."""
        keys = b"".join(self.content_keys(token_ids))
        with self._lock:
            h = ctypes.c_void_p()
            got = ctypes.c_uint64()
            self._call("kvc_seq_attach", keys, len(keys) // 16, ctypes.byref(h),
                       ctypes.byref(got))
            s = Sequence(self, h)
        s._sync()
        return s, got.value

    # ---- attention ----
    def _attend(self, fname, layer, seqs, q, centered):
        m = self._need_model()
        single = isinstance(seqs, Sequence)
        if single:
            seqs = [seqs]
        seqs = list(seqs)
        if not seqs:
            raise ValueError("attend: no sequences")
        for s in seqs:
            if not isinstance(s, Sequence):
                raise TypeError("attend: %r is not a kvd.Sequence" % (s,))
            if s._client is not self:
                raise ValueError("attend: sequence %d belongs to another client" % s.id)
            s._handle()
        self._check_layer(layer)
        n = len(seqs)
        q = np.asarray(q)
        if single and q.ndim == 2:
            q = q[None]
        q = _f32(q, "q", (n, m.q_heads, m.head_dim))
        o = np.empty((n, m.q_heads, m.head_dim), np.float32)
        lse = np.empty((n, m.q_heads), np.float32)
        arr = (ctypes.c_void_p * n)(*[s._h for s in seqs])
        with self._lock:
            self._call(fname, layer, arr, n, _ptr(q), _ptr(o), _ptr(lse))
        if not centered:
            lse += np.stack([s.lse_shift(layer, qi) for s, qi in zip(seqs, q)])
        if single:
            return o[0], lse[0]
        return o, lse

    def attend(self, layer, seqs, q, *, centered=True):
        """Attention of one layer (kvc_attend): kvd's sampled part merged
        with the exact local part (sinks + window).

        seqs: a Sequence with q [q_heads][head_dim], or a list of n with q
        [n][q_heads][head_dim]; float32.  Returns (o, lse) of the same
        leading shape, float32.  lse is over centered keys (q·(k-m)/√d, m
        the layer's centering mean) unless centered=False, which adds
        q·m/√d back so it is the lse of the raw keys."""
        return self._attend("kvc_attend", layer, seqs, q, centered)

    def attend_kvd(self, layer, seqs, q, *, centered=True):
        """kvd's part alone (kvc_attend_kvd): (o, lse) over the positions
        ``Sequence.kvd_range(layer)`` names, to merge with your own exact
        part of the rest (``kvd.merge``).  Pass centered=False when your
        part's lse is over raw keys (it usually is).  An empty part is
        (0, -inf)."""
        return self._attend("kvc_attend_kvd", layer, seqs, q, centered)

    def _check_layer(self, layer):
        m = self._need_model()
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < m.layers:
            raise ValueError("layer %r out of range [0, %d)" % (layer, m.layers))

    # ---- misc ----
    def nop(self):
        """A NOP through the rings (a round-trip probe)."""
        with self._lock:
            self._call("kvc_nop")

    def server_stats(self):
        st = _lib.KvcStats()
        with self._lock:
            self._call("kvc_server_stats", ctypes.byref(st))
        return _from_struct(ServerStats, st)

    def timing(self, reset=False):
        t = _lib.KvcTiming()
        with self._lock:
            self._call("kvc_timing", ctypes.byref(t), int(bool(reset)))
        return _from_struct(Timing, t)

    def __repr__(self):
        return "<kvd.Client %s%s>" % ("closed" if self.closed else self.backend,
                                      " model=%s" % self._model.name if self._model else "")


class Sequence:
    """One sequence (struct kvc_seq) of a Client.  free() it, use it as a
    context manager, or let it be garbage-collected; Client.close() frees
    the ones left."""

    def __init__(self, client, handle, reopened=False):
        self._client = client
        self._h = handle
        self.reopened = reopened
        with client._lock:
            self.id = client._lib.kvc_seq_id(handle)
        m = client.model
        self._layers = [_Layer() for _ in range(m.layers)]
        self._dense = set(m.dense_layers)
        client._seqs[id(self)] = self

    def _handle(self):
        if self._h is None:
            raise ValueError("operation on a freed kvd sequence")
        self._client._handle()
        return self._h

    def free(self):
        """Frees the sequence in kvd and here (kvc_seq_free).  Idempotent."""
        c = self._client
        with c._lock:
            if self._h is None:
                return
            h, self._h = self._h, None
            c._seqs.pop(id(self), None)
            if c._h is None:
                return          # the connection went first; kvd freed it then
            rc = c._lib.kvc_seq_free(c._h, h)
            if rc < 0:
                raise KvdError("kvc_seq_free", rc, c.last_error())

    def fork(self):
        """A copy-on-write child that continues from everything this sequence
        holds now (parallel samples, beams; kvc_seq_fork): kvd shares the
        sealed segments, the rest is copied.  The two diverge independently."""
        import copy
        c = self._client
        with c._lock:
            h = ctypes.c_void_p()
            c._call("kvc_seq_fork", self._handle(), ctypes.byref(h))
            child = Sequence(c, h)
        child._layers = [copy.deepcopy(ly) for ly in self._layers]
        return child

    def _sync(self):
        """The mirror of every layer from libkvclient's own state."""
        c = self._client
        m = c.model
        for layer in range(m.layers):
            a, b = ctypes.c_uint64(), ctypes.c_uint64()
            mean = _lib.c_float_p()
            ly = self._layers[layer]
            with c._lock:
                ly.n = c._lib.kvc_seq_tokens(self._handle(), layer)
                rc = c._lib.kvc_seq_layer(self._handle(), layer, ctypes.byref(a),
                                          ctypes.byref(b), ctypes.byref(mean))
            if rc < 0:
                raise KvdError("kvc_seq_layer", rc, "not on this backend")
            ly.start, ly.end = a.value, b.value
            ly.mean = (np.ctypeslib.as_array(mean, shape=(m.kv_heads, m.head_dim)).copy()
                       if mean else None)

    def publish(self, token_ids):
        """Publishes the sequence as it is now (kvc_seq_publish) under the key
        of token_ids, its tokens so far: a whole number of chunks."""
        keys = self._client.content_keys(token_ids)
        if not keys or len(keys) * self._client.chunk_tokens() != len(token_ids):
            raise ValueError("publish: %d token ids are not a whole number of chunks"
                             % len(token_ids))
        c = self._client
        with c._lock:
            c._call("kvc_seq_publish", self._handle(), keys[-1])

    def extend(self, layer, k, v):
        """n more tokens of one layer (kvc_extend): k, v float32
        [kv_heads][n][head_dim]; a prefill when the layer has none yet."""
        m, k, v = self._kv(layer, k, v, True)
        c = self._client
        with c._lock:
            c._call("kvc_extend", self._handle(), layer, _ptr(k), _ptr(v), k.shape[1])
        self._sync()

    @property
    def freed(self):
        return self._h is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass

    def _kv(self, layer, k, v, n_axis):
        c = self._client
        c._check_layer(layer)
        m = c._need_model()
        shape = (m.kv_heads, None, m.head_dim) if n_axis else (m.kv_heads, m.head_dim)
        k = _f32(k, "k", shape)
        v = _f32(v, "v", shape)
        if k.shape != v.shape:
            raise ValueError("k %s and v %s differ in shape" % (k.shape, v.shape))
        return m, k, v

    def prefill(self, layer, k, v):
        """The prompt's keys and values of one layer (kvc_prefill): k, v
        float32 [kv_heads][n][head_dim], post-RoPE, not centered.  Once per
        layer.  Sparse layers: positions [sink, n - window) go to kvd."""
        m, k, v = self._kv(layer, k, v, True)
        n = k.shape[1]
        if n >= 1 << 32:
            raise ValueError("prefill: %d tokens do not fit a uint32" % n)
        c = self._client
        with c._lock:
            c._call("kvc_prefill", self._handle(), layer, _ptr(k), _ptr(v), n)
        ly = self._layers[layer]
        ly.n = n
        if layer in self._dense:
            ly.start = ly.end = 0
            return
        lo = min(n, m.sink)
        hi = n - m.window if n - lo > m.window else lo
        ly.start, ly.end = lo, hi
        # kvd_prep_mean: the mean of the offloaded keys (double sums), 0 if none
        if hi > lo:
            ly.mean = (k[:, lo:hi].astype(np.float64).sum(axis=1) / (hi - lo)).astype(np.float32)
        else:
            ly.mean = np.zeros((m.kv_heads, m.head_dim), np.float32)

    def append(self, layer, k, v):
        """One decoded token of one layer (kvc_append): k, v float32
        [kv_heads][head_dim].  Tokens leaving the window go to kvd
        APPEND_BATCH at a time."""
        m, k, v = self._kv(layer, k, v, False)
        c = self._client
        with c._lock:
            c._call("kvc_append", self._handle(), layer, _ptr(k), _ptr(v))
        ly = self._layers[layer]
        ly.n += 1
        if layer not in self._dense and ly.n - ly.end >= m.window + APPEND_BATCH:
            ly.end += APPEND_BATCH

    def tokens(self, layer):
        """Tokens of the layer so far (prefill + appends)."""
        return self._layers[layer].n

    def kvd_range(self, layer):
        """(start, end): kvd holds positions [start, end) of the layer; the
        client keeps [0, start) (the sinks) and [end, tokens) (the window
        and up to APPEND_BATCH tokens waiting to go).  Dense layers: (0, 0)."""
        if self.reopened:
            raise ValueError("sequence %d was reopened: its local part is gone" % self.id)
        ly = self._layers[layer]
        return ly.start, ly.end

    def mean(self, layer):
        """The layer's centering mean [kv_heads][head_dim] (None: dense or
        not prefilled)."""
        return self._layers[layer].mean

    def lse_shift(self, layer, q):
        """q·m/√d per q head (q: [q_heads][head_dim]): what turns an lse over
        this layer's centered keys into one over raw keys."""
        c = self._client
        m = c._need_model()
        if self.reopened:
            raise ValueError("sequence %d was reopened: its centering mean is not known here"
                             % self.id)
        mean = self._layers[layer].mean
        if mean is None:
            return np.zeros(m.q_heads, np.float32)
        q = np.asarray(q, np.float32).reshape(m.kv_heads, m.group, m.head_dim)
        s = np.einsum("hgd,hd->hg", q.astype(np.float64), mean.astype(np.float64))
        return (s.reshape(m.q_heads) / math.sqrt(m.head_dim)).astype(np.float32)

    def stats(self):
        """kvc_seq_stats: what kvd holds of the sequence."""
        st = _lib.KvcSeqStats()
        c = self._client
        with c._lock:
            c._call("kvc_seq_stats", self._handle(), ctypes.byref(st))
        r = _from_struct(SeqStats, st)
        r.state = SEQ_STATES[st.state] if st.state < len(SEQ_STATES) else str(st.state)
        r.durable = bool(st.durable)
        return r

    def evict(self):
        """Asks kvd to write the sequence to disk and drop it from RAM
        (kvc_seq_evict; needs kvd's spill tier)."""
        c = self._client
        with c._lock:
            c._call("kvc_seq_evict", self._handle())

    def prefetch(self):
        """The sequence will be used soon: kvd starts reading it back if it
        is on disk (kvc_prefetch)."""
        c = self._client
        with c._lock:
            c._call("kvc_prefetch", self._handle())

    def attend(self, layer, q, *, centered=True):
        """Client.attend for this sequence alone: q [q_heads][head_dim]."""
        return self._client.attend(layer, self, q, centered=centered)

    def attend_kvd(self, layer, q, *, centered=True):
        return self._client.attend_kvd(layer, self, q, centered=centered)

    def __repr__(self):
        return "<kvd.Sequence %d%s>" % (self.id, " freed" if self.freed else "")


def connect(socket_path=None, tenant=None, name=None, **kw):
    """A Client (kvc_connect).  socket_path: default /run/kvd/kvd.sock."""
    return Client(socket_path, tenant, name, **kw)
