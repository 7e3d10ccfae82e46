"""Atomic file writes: a checkpoint or export that fails part-way (a full disk, a file-size limit, an interrupt) leaves
the previous file of that name intact and no temporary file behind. A path that is a symlink (`models/best.pth ->
/data/ckpt/best.pth`) is written through, as stock fastai does: the file it points to is replaced, the link stays."""
from __future__ import annotations
import os, uuid
from contextlib import contextmanager
from pathlib import Path

__all__ = ['atomic_write']

def _fsync_dir(folder:Path):
    "Make the rename itself durable (POSIX); a platform that cannot open a folder (Windows) has nothing to do here."
    try: fd = os.open(folder, os.O_RDONLY)
    except OSError: return
    try: os.fsync(fd)
    except OSError: pass
    finally: os.close(fd)

def _target(path:Path) -> Path:
    "The file a write to `path` must replace: `path`, or the end of its chain of symlinks (which need not exist yet)."
    res = Path(os.path.realpath(path))
    if res.is_symlink(): raise OSError(f"atomic_write: cannot write {str(path)!r}: its symlinks form a loop ({str(res)!r}); "
                                       "point the link at a file, or remove it")
    return res

@contextmanager
def atomic_write(
    path, # the file to (over)write: it changes only once the whole new content is on disk (a symlink: the file it points to)
):
    "Yield a binary file opened on a temporary file next to `path`; on success it is flushed, fsynced and renamed over `path`."
    path = _target(Path(path))  # a symlink is kept: the temporary file goes next to its target, and replaces that
    tmp = path.with_name(f'.{path.name}.{uuid.uuid4().hex[:12]}.tmp')  # same folder: `os.replace` is a rename
    try:
        with open(tmp, 'xb') as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try: os.unlink(tmp)
        except FileNotFoundError: pass
        raise
    _fsync_dir(path.parent)
