"""What kvd computes, in numpy, for checking it (docs/ARCHITECTURE.md,
"The estimator"): bf16 rounding, SimHash codes, and the MagicPIG estimate
of attention over kvd's part."""
import math

import numpy as np


def bf16(x):
    """x rounded to bfloat16 (nearest, ties to even) and back to float32,
    as kvd stores keys and values."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def hash_bits(x, W, K, L):
    """Sign bits of x·W: x [..., d], W [d][K*L] -> bool [..., L, K] (table
    t's code packs bits [t, 0..K))."""
    y = np.asarray(x, np.float32) @ W
    return (y > 0).reshape(np.shape(x)[:-1] + (L, K))


def log_p(cos, K, L, c):
    """ln P(key sampled) at cos θ (the profile's K, L, c), floored at -80."""
    th = np.arccos(np.clip(cos, -1.0, 1.0))
    p = (1.0 - th / math.pi) ** K
    P = 1 - (1 - p) ** L
    if c == 2:
        P = P - L * p * (1 - p) ** (L - 1)
    with np.errstate(divide="ignore"):
        return np.maximum(np.log(np.maximum(P, 0.0)), -80.0)


def estimate(q, k, v, mean, W, K, L, c):
    """kvd's answer for its part, recomputed: q [q_heads, d] (raw); k, v
    [kv_heads, n, d] the raw keys and values of the positions kvd holds
    (Sequence.kvd_range); mean [kv_heads, d] the layer's centering mean
    (Sequence.mean); W, K, L, c from the profile (Client.w, Client.model).
    Returns (o, lse, sampled): o [q_heads, d], lse [q_heads] over centered
    keys (what attend_kvd returns with centered=True), float64, and the
    fraction of keys each q head sampled."""
    q = np.asarray(q, np.float32)
    Q, d = q.shape
    H = k.shape[0]
    G = Q // H
    kc = bf16(np.asarray(k, np.float32) - np.asarray(mean, np.float32)[:, None])
    vb = bf16(v).astype(np.float64)
    kb, qb = hash_bits(kc, W, K, L), hash_bits(q, W, K, L)
    o = np.zeros((Q, v.shape[-1]))
    lse = np.full(Q, -np.inf)
    sampled = np.zeros(Q)
    for h in range(Q):
        g = h // G
        sel = (kb[g] == qb[h][None]).all(-1).sum(-1) >= c
        sampled[h] = sel.mean() if sel.size else 0.0
        if not sel.any():
            continue
        ks = kc[g][sel].astype(np.float64)
        qq = q[h].astype(np.float64)
        dot = ks @ qq
        cos = dot / (np.linalg.norm(ks, axis=1) * np.linalg.norm(qq))
        s = dot / math.sqrt(d) - log_p(cos, K, L, c)
        mx = s.max()
        e = np.exp(s - mx)
        o[h] = e @ vb[g][sel] / e.sum()
        lse[h] = mx + math.log(e.sum())
    return o, lse, sampled
