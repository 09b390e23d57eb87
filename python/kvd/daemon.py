"""Starting a private kvd for tests and examples, the way the C integration
tests do (tests/integration/daemon.h): a temporary directory, the socket in
it, --foreground, stopped with SIGTERM (a clean drain exits 0)."""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from . import _lib


def find_kvd():
    """The kvd binary: $KVD_BIN, else next to the loaded libkvclient.so
    (the build dir holds both), else the source tree's build/kvd, else kvd
    on $PATH.  None when none is found."""
    env = os.environ.get("KVD_BIN")
    if env:
        return env
    try:
        here = os.path.dirname(os.path.realpath(_lib.loaded_path()))
        cands = [os.path.join(here, "kvd")]
    except OSError:
        cands = []
    cands.append(os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir,
                                               "build", "kvd")))
    for c in cands:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return shutil.which("kvd")


class Daemon:
    """A kvd of one's own: ``with Daemon() as d: kvd.connect(d.socket)``.

    binary: kvd's path (default: find_kvd()); args: extra flags after the
    defaults (so they override them); threads: --threads."""

    def __init__(self, binary=None, args=(), threads=2, log_level="warning", timeout=10.0):
        self.binary = binary or find_kvd()
        if not self.binary:
            raise FileNotFoundError("kvd binary not found: set KVD_BIN")
        self.dir = tempfile.mkdtemp(prefix="kvd-py.")
        self.socket = os.path.join(self.dir, "kvd.sock")
        self.log = open(os.path.join(self.dir, "kvd.log"), "w+b")
        self.proc = subprocess.Popen(
            [self.binary, "--foreground", "--socket", self.socket, "--threads", str(threads),
             "--log-level", os.environ.get("KVD_TEST_LOG") and "debug" or log_level, *args],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self._can_connect():
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = self.output()
                self.stop()
                raise RuntimeError("kvd did not start (%s):\n%s" % (
                    "exit %s" % self.proc.returncode if self.proc.returncode is not None
                    else "timeout", out))
            time.sleep(0.02)

    def _can_connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(self.socket)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def output(self):
        """What kvd logged so far."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self, timeout=30.0):
        """SIGTERM and wait: kvd's exit status (0: drained and exited
        cleanly).  Idempotent."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.dir:
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
