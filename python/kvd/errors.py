"""kvd's errors as Python exceptions."""
import errno as _errno

# engine/err.h: kvd's own codes, above every errno.
KVD_CODES = {4097: "KVD_EGEOM", 4098: "KVD_EFORMAT", 4099: "KVD_ESHAPE", 4100: "KVD_ELOST",
             4101: "KVD_EPROTO"}


def code_name(code):
    """'ENOENT', 'KVD_ELOST', ... for a negative kvc return code."""
    n = -code
    return KVD_CODES.get(n) or _errno.errorcode.get(n) or "error %d" % code


class KvdError(Exception):
    """A libkvclient call failed.

    ``code``: what the call returned (-errno or -KVD_E*); ``errno``: its
    absolute value; ``name``: e.g. ``"ENOENT"``; ``message``: the reason as
    libkvclient and kvd put it (``kvc_last_error()``, e.g. ``"kvd: no
    sequence 7"``); ``op``: the C function that failed.
    """

    def __init__(self, op, code, message):
        self.op = op
        self.code = code
        self.errno = -code
        self.name = code_name(code)
        self.message = message
        super().__init__("%s: %s (%s)" % (op, message or "failed", self.name))
