"""Loading libkvclient.so and declaring its C API (gpu-client/kvc.h) to ctypes.

Where the library is looked for, first match wins:

1. ``$KVD_LIBKVCLIENT``: a path to the library (or to a directory holding
   ``libkvclient.so``).  When set, nothing else is tried.
2. Next to the package: ``libkvclient.so`` in the ``kvd`` package directory
   (where one may copy it when vendoring the package).
3. The build directory of the source tree the package sits in:
   ``<repo>/build/libkvclient.so`` when the package is imported from
   ``<repo>/python/kvd``.
4. The system: ``ctypes.util.find_library("kvclient")`` (ldconfig's cache),
   then ``libkvclient.so`` through the dynamic loader's own search
   (``LD_LIBRARY_PATH``, ``/etc/ld.so.conf``).
"""
import ctypes
import ctypes.util
import os
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
LIBNAME = "libkvclient.so"

c_float_p = ctypes.POINTER(ctypes.c_float)
c_u32_p = ctypes.POINTER(ctypes.c_uint32)
c_u64_p = ctypes.POINTER(ctypes.c_uint64)


class KvcOpts(ctypes.Structure):
    _fields_ = [
        ("socket_path", ctypes.c_char_p),
        ("tenant", ctypes.c_char_p),
        ("name", ctypes.c_char_p),
        ("poll", ctypes.c_int),
        ("slots", ctypes.c_uint32),
        ("slot_size", ctypes.c_uint64),
        ("spin_ns", ctypes.c_uint64),
        ("backend", ctypes.c_int),
        ("device", ctypes.c_int),
        ("max_batch", ctypes.c_uint32),
        ("timing", ctypes.c_int),
    ]


class KvcModel(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("layers", ctypes.c_uint32),
        ("q_heads", ctypes.c_uint32),
        ("kv_heads", ctypes.c_uint32),
        ("head_dim", ctypes.c_uint32),
        ("K", ctypes.c_uint32),
        ("L", ctypes.c_uint32),
        ("c", ctypes.c_uint32),
        ("sink", ctypes.c_uint32),
        ("window", ctypes.c_uint32),
        ("estimator", ctypes.c_uint32),    # enum kvc_estimator; in what was padding
        ("dense_layers", c_u32_p),
        ("n_dense", ctypes.c_uint32),
        ("kv_dtype", ctypes.c_uint32),     # enum kvc_kv_dtype; in what was padding
        ("seed", ctypes.c_uint64),
        ("segment_tokens", ctypes.c_uint32),
        ("seal_tokens", ctypes.c_uint32),
    ]


_u64 = ctypes.c_uint64
_u32 = ctypes.c_uint32


class KvcStats(ctypes.Structure):
    _fields_ = [(n, _u32) for n in ("clients", "sequences", "profiles", "slots_in_use")] + \
        [(n, _u64) for n in ("bytes", "requests", "errors", "disconnects", "mapped_bytes",
                             "mem_limit", "mem_high", "mem_low", "reserved_bytes",
                             "disk_bytes")] + \
        [("on_disk", _u32)] + \
        [(n, _u64) for n in ("spills", "restores", "drops", "spill_errors", "lost",
                             "spill_bytes", "restore_bytes", "used_bytes", "refused")]


class KvcSeqStats(ctypes.Structure):
    _fields_ = [
        ("tokens", _u64),
        ("bytes", _u64),
        ("segments", _u32),
        ("state", _u32),
        ("durable", ctypes.c_int),
        ("disk_bytes", _u64),
        ("ready_layers", _u32),
    ]


class KvcTiming(ctypes.Structure):
    _fields_ = [(n, _u64) for n in ("attends", "appends", "evicted", "prefills")] + \
        [(n, ctypes.c_double) for n in ("kvd_wait_ms", "gpu_wait_ms", "evict_ms", "prefill_ms",
                                        "hash_ms", "window_ms", "h2d_ms", "merge_ms")]


_vp = ctypes.c_void_p
_int = ctypes.c_int

# name: (restype, argtypes).  `struct kvc *` and `struct kvc_seq *` are opaque
# void pointers; arrays of sequences are (void *)[n].
_PROTOS = {
    "kvc_connect": (_int, [ctypes.POINTER(KvcOpts), ctypes.POINTER(_vp)]),
    "kvc_close": (None, [_vp]),
    "kvc_last_error": (ctypes.c_char_p, [_vp]),
    "kvc_backend": (_int, [_vp]),
    "kvc_profile": (_int, [_vp, ctypes.POINTER(KvcModel)]),
    "kvc_model_of": (ctypes.POINTER(KvcModel), [_vp]),
    "kvc_w": (c_float_p, [_vp]),
    "kvc_seq_create": (_int, [_vp, ctypes.POINTER(_vp)]),
    "kvc_seq_fork": (_int, [_vp, _vp, ctypes.POINTER(_vp)]),
    "kvc_seq_id": (_u64, [_vp]),
    "kvc_seq_free": (_int, [_vp, _vp]),
    "kvc_prefill": (_int, [_vp, _vp, _u32, _vp, _vp, _u32]),
    "kvc_append": (_int, [_vp, _vp, _u32, _vp, _vp]),
    "kvc_attend": (_int, [_vp, _u32, _vp, _u32, _vp, _vp, _vp]),
    "kvc_attend_kvd": (_int, [_vp, _u32, _vp, _u32, _vp, _vp, _vp]),
    "kvc_nop": (_int, [_vp]),
    "kvc_server_stats": (_int, [_vp, ctypes.POINTER(KvcStats)]),
    "kvc_seq_stats": (_int, [_vp, _vp, ctypes.POINTER(KvcSeqStats)]),
    "kvc_seq_open": (_int, [_vp, _u64, ctypes.POINTER(_vp), c_u64_p]),
    "kvc_seq_evict": (_int, [_vp, _vp]),
    "kvc_prefetch": (_int, [_vp, _vp]),
    "kvc_timing": (_int, [_vp, ctypes.POINTER(KvcTiming), _int]),
    "kvc_chunk_tokens": (_u32, [_vp]),
    "kvc_content_keys": (_int, [_vp, ctypes.POINTER(_u32), ctypes.c_size_t, _vp]),
    "kvc_seq_publish": (_int, [_vp, _vp, _vp]),
    "kvc_seq_attach": (_int, [_vp, _vp, _u32, ctypes.POINTER(_vp), c_u64_p]),
    "kvc_extend": (_int, [_vp, _vp, _u32, _vp, _vp, _u32]),
    "kvc_seq_tokens": (_u64, [_vp, _u32]),
    "kvc_seq_layer": (_int, [_vp, _u32, c_u64_p, c_u64_p, ctypes.POINTER(c_float_p)]),
}

_lock = threading.Lock()
_lib = None
_path = None


def candidates():
    """The places tried, in order, as (description, path-or-name)."""
    env = os.environ.get("KVD_LIBKVCLIENT")
    if env:
        if os.path.isdir(env):
            env = os.path.join(env, LIBNAME)
        return [("$KVD_LIBKVCLIENT", env)]
    out = [("next to the package", os.path.join(_HERE, LIBNAME)),
           ("the source tree's build dir",
            os.path.normpath(os.path.join(_HERE, os.pardir, os.pardir, "build", LIBNAME)))]
    found = ctypes.util.find_library("kvclient")
    if found:
        out.append(("ctypes.util.find_library", found))
    out.append(("the dynamic loader's search path", LIBNAME))
    return out


def load():
    """The loaded library (a ctypes.CDLL), loading it on first use."""
    global _lib, _path
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for what, p in candidates():
            if os.sep in p and not os.path.exists(p):
                tried.append("%s (%s): not there" % (p, what))
                continue
            try:
                lib = ctypes.CDLL(p)
            except OSError as e:
                tried.append("%s (%s): %s" % (p, what, e))
                continue
            for name, (res, args) in _PROTOS.items():
                f = getattr(lib, name)
                f.restype = res
                f.argtypes = args
            _lib, _path = lib, p
            return lib
        raise OSError("libkvclient.so not found; set KVD_LIBKVCLIENT to its path. Tried:\n  " +
                      "\n  ".join(tried))


def path():
    """The path (or name) libkvclient.so was loaded from."""
    load()
    return _path


def loaded_path():
    """Where the loaded libkvclient.so lives on disk (from /proc/self/maps),
    else what it was loaded as."""
    load()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split(None, 5)[-1].strip()
                if p.endswith("/" + LIBNAME):
                    return p
    except OSError:
        pass
    return _path
