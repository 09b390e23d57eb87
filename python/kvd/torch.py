"""PyTorch helpers: the kvd API with torch tensors in and out.

Tensors may live on any device and have any floating dtype (float32,
bfloat16, float16, ...): libkvclient's host API takes float32 on the CPU,
so inputs are copied to contiguous CPU float32 and outputs come back as
float32 on the query's device.  (The stream-ordered device API, kvc_*_dev,
is not wrapped yet.)

    import kvd, kvd.torch as kt
    kt.prefill(seq, layer, k, v)             # k, v [kv_heads, n, d]
    kt.append(seq, layer, k1, v1)            # k1, v1 [kv_heads, d]
    o, lse = kt.attend_split(client, layer, [seq], q[None], [K], [V])
"""
import math

import torch

from .client import Sequence


def to_numpy(t, what="tensor"):
    """t as a C-contiguous float32 numpy array on the CPU (a copy when it
    has to be one)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s: a torch.Tensor, not %s" % (what, type(t).__name__))
    if not t.is_floating_point():
        raise TypeError("%s: dtype %s, expected a floating dtype" % (what, t.dtype))
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()


def prefill(seq, layer, k, v):
    """Sequence.prefill with k, v tensors [kv_heads, n, head_dim]."""
    seq.prefill(layer, to_numpy(k, "k"), to_numpy(v, "v"))


def append(seq, layer, k, v):
    """Sequence.append with k, v tensors [kv_heads, head_dim]."""
    seq.append(layer, to_numpy(k, "k"), to_numpy(v, "v"))


def _out(x, like):
    return torch.from_numpy(x).to(like.device)


def attend(client, layer, seqs, q, *, centered=True):
    """Client.attend with q a tensor ([q_heads, d] for one Sequence,
    [n, q_heads, d] for a list); (o, lse) float32 on q's device."""
    o, lse = client.attend(layer, seqs, to_numpy(q, "q"), centered=centered)
    return _out(o, q), _out(lse, q)


def attend_kvd(client, layer, seqs, q, *, centered=True):
    """Client.attend_kvd with tensors, as attend()."""
    o, lse = client.attend_kvd(layer, seqs, to_numpy(q, "q"), centered=centered)
    return _out(o, q), _out(lse, q)


def merge(o1, lse1, o2, lse2):
    """The LSE merge of two (o, lse) pairs (o [..., d], lse [...]); empty
    parts (lse = -inf) allowed.  Computed in float32 at least."""
    dt = torch.promote_types(o1.dtype, torch.float32)
    a, b = lse1.to(dt), lse2.to(dt)
    mx = torch.maximum(a, b)
    safe = torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx)
    wa = torch.where(torch.isneginf(a), torch.zeros_like(a), torch.exp(a - safe))
    wb = torch.where(torch.isneginf(b), torch.zeros_like(b), torch.exp(b - safe))
    tot = wa + wb
    o = (wa[..., None] * o1.to(dt) + wb[..., None] * o2.to(dt)) / tot.clamp_min(1e-38)[..., None]
    o = torch.where(tot[..., None] > 0, o, torch.zeros_like(o))
    lse = torch.where(tot > 0, safe + torch.log(tot.clamp_min(1e-38)),
                      torch.full_like(tot, -math.inf))
    return o, lse


def attend_exact(q, k, v, positions=None):
    """Exact attention with its lse, GQA: q [..., q_heads, d]; k, v
    [kv_heads, n, d]; positions: the key positions to attend (an index
    tensor or slice; None: all).  Returns (o, lse) in float32 at least;
    no key gives (0, -inf)."""
    if positions is not None:
        k, v = k[:, positions], v[:, positions]
    dt = torch.promote_types(q.dtype, torch.float32)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    hq, d = q.shape[-2:]
    hk, n = k.shape[0], k.shape[1]
    lead = q.shape[:-2]
    if n == 0:
        return (q.new_zeros(lead + (hq, v.shape[-1])), q.new_full(lead + (hq,), -math.inf))
    qg = q.reshape(lead + (hk, hq // hk, d))
    s = torch.einsum("...hgd,hnd->...hgn", qg, k) / math.sqrt(d)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("...hgn,hne->...hge", torch.exp(s - lse[..., None]), v)
    return o.reshape(lead + (hq, v.shape[-1])), lse.reshape(lead + (hq,))


def local_positions(seq, layer, device=None):
    """The positions the client keeps of a layer (sinks, then the window
    and the tokens waiting to go to kvd), as an index tensor: the
    complement of Sequence.kvd_range(layer)."""
    a, b = seq.kvd_range(layer)
    n = seq.tokens(layer)
    return torch.cat([torch.arange(0, a), torch.arange(b, n)]).to(device)


def attend_split(client, layer, seqs, q, ks, vs):
    """What a GPU decoder does: exact attention over each sequence's local
    positions (its sinks and window, read from the caller's own cache)
    merged with kvd's sampled part of the rest.

    seqs: n Sequences; q [n, q_heads, d]; ks[i], vs[i]: sequence i's whole
    K/V cache of this layer [kv_heads, tokens, d], raw (post-RoPE), where
    only the local positions are read (kvd has the rest).  Returns (o, lse)
    [n, q_heads, d], [n, q_heads], float32 on q's device, lse over raw keys.
    Dense layers are attended here whole (they need no prefill in kvd)."""
    if isinstance(seqs, Sequence):
        raise TypeError("attend_split: a list of sequences (and q [n, q_heads, d])")
    seqs = list(seqs)
    if len(ks) != len(seqs) or len(vs) != len(seqs) or q.shape[0] != len(seqs):
        raise ValueError("attend_split: %d sequences, %d queries, %d/%d caches"
                         % (len(seqs), q.shape[0], len(ks), len(vs)))
    dense = layer in client.model.dense_layers
    # kvc_attend_kvd returns with kvd's answer, so here the two parts run
    # one after the other (kvc_attend overlaps them inside the library).
    if not dense:
        ok, lk = attend_kvd(client, layer, seqs, q, centered=False)
    os, ls = [], []
    for i, s in enumerate(seqs):
        if not dense and ks[i].shape[1] != s.tokens(layer):
            raise ValueError("attend_split: cache of sequence %d holds %d tokens, kvd's "
                             "sequence %d" % (s.id, ks[i].shape[1], s.tokens(layer)))
        pos = None if dense else local_positions(s, layer, ks[i].device)
        o, lse = attend_exact(q[i], ks[i], vs[i], pos)
        os.append(o)
        ls.append(lse)
    o, lse = torch.stack(os).float(), torch.stack(ls).float()
    if dense:
        return o, lse
    return merge(o, lse, ok.to(o.device), lk.to(o.device))
