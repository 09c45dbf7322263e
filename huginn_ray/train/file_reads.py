"""A file of a local path or of a bucket (huginn_ray.storage) as a seekable, buffered Python binary file: what
torch.load, pickle and DCP's reader take. On a bucket every read is a ranged GET, so reading a piece of a
checkpoint file never downloads the whole object."""

from __future__ import annotations

import io

from huginn_ray import storage


class _ArrowFile(io.RawIOBase):
    """A `pyarrow` input file (huginn_ray.storage.open_input_file) as a Python binary file: every read of a bucket's
    object is one ranged GET of the bytes asked for."""

    def __init__(self, native):
        self.native = native

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset, whence=io.SEEK_SET):
        return self.native.seek(offset, whence)

    def tell(self):
        return self.native.tell()

    def readinto(self, buffer):
        return self.native.readinto(buffer)

    def close(self):
        self.native.close()
        super().close()


BUCKET_BUFFER_BYTES = 2**20
"""Read-ahead of an object in a bucket: torch.load and pickle read an archive's header and records in small
pieces, which would each be a ranged GET."""


def open_for_reading(location):
    """A seekable, buffered binary file: a local file opened by `open` (as every local reader), a bucket's object
    through huginn_ray.storage.open_input_file (ranged reads, never the whole object); FileNotFoundError naming the
    location when there is none."""
    location = str(location)
    if not storage.is_uri(location):
        return open(location, "rb")
    return io.BufferedReader(_ArrowFile(storage.open_input_file(location)), BUCKET_BUFFER_BYTES)
