"""The LSE merge and an exact attention with its lse, in numpy.

(o, lse) of a set of keys: o = Σ softmax(s)_i v_i, lse = ln Σ exp(s_i), with
s_i = q·k_i/√d; the empty set is (0, -inf).  Two disjoint sets merge as

    lse = ln(e^lse1 + e^lse2),  o = (e^lse1 o1 + e^lse2 o2) / e^lse

which is how kvd's part (``Client.attend_kvd``) and the caller's exact part
(sinks + window) make the attention over all keys (docs/ARCHITECTURE.md).
"""
import numpy as np


def merge(o1, lse1, o2, lse2):
    """Merges two (o, lse) pairs: o [..., d], lse [...] (the shape of o
    without its last axis).  Either part may be empty (lse = -inf).
    Computed in float64, returned in o1's dtype (float32 for float32)."""
    o1 = np.asarray(o1)
    dt = o1.dtype if np.issubdtype(o1.dtype, np.floating) else np.float64
    a = np.asarray(lse1, np.float64)
    b = np.asarray(lse2, np.float64)
    if o1.shape != np.shape(o2) or a.shape != b.shape or a.shape != o1.shape[:-1]:
        raise ValueError("merge: shapes o1 %s, lse1 %s, o2 %s, lse2 %s do not agree"
                         % (o1.shape, a.shape, np.shape(o2), b.shape))
    mx = np.maximum(a, b)
    safe = np.where(np.isneginf(mx), 0.0, mx)
    wa = np.where(np.isneginf(a), 0.0, np.exp(a - safe))
    wb = np.where(np.isneginf(b), 0.0, np.exp(b - safe))
    tot = wa + wb
    with np.errstate(divide="ignore", invalid="ignore"):
        o = (wa[..., None] * o1 + wb[..., None] * np.asarray(o2, np.float64)) / tot[..., None]
        lse = np.where(tot > 0, safe + np.log(tot), -np.inf)
    o = np.where(tot[..., None] > 0, o, 0.0)
    return o.astype(dt), lse.astype(dt)


def attend_exact(q, k, v, scale=None):
    """Exact attention with its lse, GQA: q [..., q_heads, d]; k, v
    [kv_heads, n, d] (q head h reads kv head h // (q_heads / kv_heads)).
    Returns (o [..., q_heads, d], lse [..., q_heads]) in float64; n = 0
    gives (0, -inf)."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    hq, d = q.shape[-2:]
    hk, n = k.shape[0], k.shape[1]
    if hq % hk or k.shape[2] != d or v.shape[:2] != k.shape[:2]:
        raise ValueError("attend_exact: q %s, k %s, v %s do not agree" % (q.shape, k.shape, v.shape))
    lead = q.shape[:-2]
    if n == 0:
        return np.zeros(lead + (hq, v.shape[2])), np.full(lead + (hq,), -np.inf)
    g = hq // hk
    qg = q.reshape(lead + (hk, g, d))
    s = np.einsum("...hgd,hnd->...hgn", qg, k) * (scale if scale is not None else d ** -0.5)
    mx = s.max(axis=-1, keepdims=True)
    e = np.exp(s - mx)
    z = e.sum(axis=-1, keepdims=True)
    o = np.einsum("...hgn,hne->...hge", e / z, v)
    lse = (mx + np.log(z))[..., 0]
    return o.reshape(lead + (hq, v.shape[2])), lse.reshape(lead + (hq,))
