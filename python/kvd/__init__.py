"""kvd: Python bindings of libkvclient (ctypes), numpy in and out.

    import numpy as np, kvd
    with kvd.connect("/run/kvd/kvd.sock") as c:
        c.profile(kvd.Model("llama", layers=32, q_heads=32, kv_heads=8, head_dim=128,
                            dense_layers=(0, 16)))
        with c.sequence() as s:
            for layer in range(32):
                s.prefill(layer, k[layer], v[layer])   # float32 [kv_heads, n, d]
            o, lse = s.attend(1, q)                    # q [q_heads, d]

kvd.torch has the same with torch tensors, and attend_split (exact sinks +
window on your side merged with kvd's part).  Where libkvclient.so is
looked for: kvd._lib (KVD_LIBKVCLIENT first).
"""
from .client import (APPEND_BATCH, ESTIMATORS, KV_DTYPES, Client, Model, Sequence, SeqStats,
                     ServerStats, Timing, connect)
from .daemon import Daemon, find_kvd
from .errors import KvdError
from .merge import attend_exact, merge
from ._lib import loaded_path as library_path

__version__ = "0.1.0"

__all__ = ["APPEND_BATCH", "ESTIMATORS", "KV_DTYPES", "Client", "Daemon", "KvdError", "Model",
           "Sequence", "SeqStats", "ServerStats", "Timing", "attend_exact", "connect", "find_kvd",
           "library_path", "merge"]
