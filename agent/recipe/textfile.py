"""A recipe or cluster file read as bounded UTF-8 text, or one clear problem saying why not.

A recipe is a few KB of YAML. What a user can name instead must not hang the submitter or eat its
memory: ``/dev/zero`` or a FIFO is refused before a byte is read (opened non-blocking, so a FIFO
without a writer cannot hang the open either), a file over ``MAX_FILE_BYTES`` is refused after
reading one byte more than the limit, and a binary file is refused at its first invalid byte. An
``OSError`` (a missing file, a 300-character path component, no permission) is a problem naming
the path too, never a traceback.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from agent.problems import InputError, error

# 1 MiB: hundreds of times the largest real recipe, small enough to parse in well under a second.
MAX_FILE_BYTES = 1024 * 1024


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: Path, message: str, hint: str) -> InputError:
    return InputError([error("", message, hint)], str(path))


def read_text(path: Path, what: str) -> str:
    """The text of ``path`` (``what``: "recipe", "cluster file"); InputError when unusable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        hint = "check the file name"
        if exc.errno == errno.ENAMETOOLONG:
            hint = "a path component is longer than the file system allows (255 bytes)"
        raise _refuse(path, f"cannot read the {what}: {exc.strerror or exc}", hint) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(
                path,
                f"the {what} is {_kind(mode)}, not a regular file",
                "name a YAML file; to use generated text, write it to a file first",
            )
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise _refuse(
            path, f"cannot read the {what}: {exc.strerror or exc}", "check the file"
        ) from None
    finally:
        os.close(fd)
    if size > MAX_FILE_BYTES:
        raise _refuse(
            path,
            f"the {what} is larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB",
            f"a {what} is a few KB of YAML: check that this is the right file",
        )
    data = b"".join(chunks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise InputError(
            [
                error(
                    "",
                    f"the {what} is not UTF-8 text: invalid byte 0x{data[exc.start]:02x} at "
                    f"line {line} (a binary file?)",
                    "save it as UTF-8 text",
                    line,
                )
            ],
            str(path),
        ) from None
