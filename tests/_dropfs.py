"""A FUSE file system that loses every write not yet made durable, as a power cut does.

    python _dropfs.py BACKING MOUNTPOINT

mounts MOUNTPOINT as a view of the directory BACKING. Directory operations (create, unlink,
rename, mkdir, truncate) go straight to BACKING, like a journalled file system's metadata. File
contents do not: a ``write`` lands in this process's memory (a page cache of 4 KiB blocks that
reads see), and only ``fsync``/``fdatasync`` of the file, or a write through a descriptor opened
with ``O_SYNC``/``O_DSYNC``, copies its blocks to BACKING and syncs them there. So when this
process is killed with SIGKILL, BACKING holds exactly what a machine would find on its disk after
losing power at that moment with a write-back cache and no barrier beyond fsync: the test of the
write ordering that a durable store promises (tests/test_power_loss.py).

``lock.mdb``, LMDB's reader table (shared memory that LMDB rebuilds on open), is written through.

The process prints ``ready`` on stdout once the mount answers and stays in the foreground.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from typing import Any

import mfusepy as fuse

BLOCK = 4096
WRITE_THROUGH = ("lock.mdb",)


class FileState:
    """The unsynced part of one file: dirty blocks and the size that reads see."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.dirty: dict[int, bytearray] = {}


class DropFS(fuse.Operations):
    use_ns = True

    def __init__(self, backing: str) -> None:
        self.backing = os.path.realpath(backing)
        self._mutex = threading.Lock()
        self.files: dict[str, FileState] = {}  # by path, for files with unsynced data
        self.fds: dict[int, tuple[int, str, bool]] = {}  # fh -> (backing fd, path, sync)
        self.next_fh = 1

    # -- helpers ----------------------------------------------------------------------------
    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _state(self, path: str) -> FileState:
        st = self.files.get(path)
        if st is None:
            st = FileState(os.path.getsize(self._real(path)))
            self.files[path] = st
        return st

    def _open_fh(self, path: str, flags: int) -> int:
        fd = os.open(self._real(path), os.O_RDWR)
        sync = bool(flags & (os.O_SYNC | os.O_DSYNC)) or path.endswith(WRITE_THROUGH)
        fh = self.next_fh
        self.next_fh += 1
        self.fds[fh] = (fd, path, sync)
        return fh

    def _flush_file(self, path: str, fd: int) -> None:
        st = self.files.pop(path, None)
        if st is not None:
            for b in sorted(st.dirty):
                end = min((b + 1) * BLOCK, st.size)
                if end > b * BLOCK:
                    os.pwrite(fd, bytes(st.dirty[b][: end - b * BLOCK]), b * BLOCK)
            if os.fstat(fd).st_size < st.size:
                os.ftruncate(fd, st.size)
        os.fsync(fd)

    # -- files ------------------------------------------------------------------------------
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        try:
            s = os.lstat(self._real(path))
        except FileNotFoundError:
            raise fuse.FuseOSError(errno.ENOENT) from None
        out = {k: getattr(s, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size")}
        for k in ("st_atime", "st_mtime", "st_ctime"):
            out[k] = getattr(s, k + "_ns")
        with self._mutex:
            st = self.files.get(path)
            if st is not None:
                out["st_size"] = st.size
        return out

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        os.close(os.open(self._real(path), os.O_CREAT | os.O_RDWR, mode))
        with self._mutex:
            return self._open_fh(path, 0)

    def open(self, path: str, flags: int) -> int:
        with self._mutex:
            return self._open_fh(path, flags)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        with self._mutex:
            fd = self.fds[fh][0]
            st = self.files.get(path)
            total = st.size if st is not None else os.fstat(fd).st_size
            size = max(0, min(size, total - offset))
            buf = bytearray(os.pread(fd, size, offset))
            buf.extend(bytes(size - len(buf)))
            if st is not None:
                for b in range(offset // BLOCK, (offset + size + BLOCK - 1) // BLOCK):
                    blk = st.dirty.get(b)
                    if blk is None:
                        continue
                    lo, hi = max(offset, b * BLOCK), min(offset + size, (b + 1) * BLOCK)
                    buf[lo - offset : hi - offset] = blk[lo - b * BLOCK : hi - b * BLOCK]
            return bytes(buf)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        with self._mutex:
            fd, _, sync = self.fds[fh]
            if sync:
                os.pwrite(fd, data, offset)
                st = self.files.get(path)
                if st is not None:  # keep the cached copy in step
                    self._overlay(st, fd, data, offset)
                os.fsync(fd)
                return len(data)
            self._overlay(self._state(path), fd, data, offset)
            return len(data)

    def _overlay(self, st: FileState, fd: int, data: bytes, offset: int) -> None:
        pos = 0
        while pos < len(data):
            at = offset + pos
            b = at // BLOCK
            blk = st.dirty.get(b)
            if blk is None:
                blk = bytearray(os.pread(fd, BLOCK, b * BLOCK))
                blk.extend(bytes(BLOCK - len(blk)))
                st.dirty[b] = blk
            n = min(len(data) - pos, (b + 1) * BLOCK - at)
            blk[at - b * BLOCK : at - b * BLOCK + n] = data[pos : pos + n]
            pos += n
        st.size = max(st.size, offset + len(data))

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        with self._mutex:
            self._flush_file(path, self.fds[fh][0])
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0  # close() does not make data durable

    def release(self, path: str, fh: int) -> int:
        with self._mutex:
            fd = self.fds.pop(fh)[0]
            os.close(fd)
        return 0

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        with self._mutex:
            os.truncate(self._real(path), length)
            st = self.files.get(path)
            if st is not None:
                st.size = length
                for b in [b for b in st.dirty if b * BLOCK >= length]:
                    del st.dirty[b]
        return 0

    def unlink(self, path: str) -> int:
        with self._mutex:
            os.unlink(self._real(path))
            self.files.pop(path, None)
        return 0

    def rename(self, old: str, new: str) -> int:
        with self._mutex:
            os.rename(self._real(old), self._real(new))
            if old in self.files:
                self.files[new] = self.files.pop(old)
        return 0

    # -- directories and the rest -----------------------------------------------------------
    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._real(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._real(path))
        return 0

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._real(path))]

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._real(path), mode)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        os.utime(self._real(path), ns=times)
        return 0

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._real(path), amode):
            raise fuse.FuseOSError(errno.EACCES)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        s = os.statvfs(self._real(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files")
        return {k: getattr(s, k) for k in (*keys, "f_flag", "f_frsize", "f_namemax")}


def main() -> int:
    backing, mount = sys.argv[1], sys.argv[2]

    def announce() -> None:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mount):
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        sys.stdout.write("ready\n")
        sys.stdout.flush()

    threading.Thread(target=announce, daemon=True).start()
    fuse.FUSE(DropFS(backing), mount, foreground=True, allow_other=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
