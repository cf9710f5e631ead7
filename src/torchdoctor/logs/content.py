"""Is it a text log at all? Told from the first bytes, before a line is read.

``torchdoctor logs ckpt.pt`` (a checkpoint passed by mistake) used to read 1 MiB of binary as 4,000 "lines" and say
it found no failure: a verdict on nothing. :func:`not_text` looks at the stream's first :data:`SNIFF` bytes (after
gzip, when the file was gzip: a ``.tar.gz`` of checkpoints is not a gzip log) and names what they are:

- by their signature, the files people pass by mistake: a zip archive (``torch.save`` writes one since torch 1.6:
  ``archive/data.pkl`` inside; a ``.zip``), a pickle (protocol 2-5 opens with ``\\x80`` and the protocol byte: the
  legacy ``torch.save`` format, a Flight Recorder dump, ``pickle.dump``), safetensors (an 8-byte little-endian header
  length, then that many bytes of JSON starting ``{``), numpy's ``.npy`` (``\\x93NUMPY``), HDF5 (Keras ``.h5``), a
  tar archive (``ustar`` at offset 257), compressed files other than gzip (bzip2, xz, zstd, 7-zip: decompress
  them first), ELF executables and shared libraries, and images;
- else by what is in them: text has no control characters but tab, newline, carriage return, form feed, backspace
  and escape (colours); random bytes have about 1 in 10. More than 1 in 100 of the sniffed bytes (runs of NUL
  bytes left out: a log a crash left with a hole of zeros is still a log, and one that starts with only zeros is
  read on) is binary.

UTF-16 text (PowerShell's ``>``) is text: the reader decodes it (:func:`..reading.decoder_for`).
"""

from __future__ import annotations

import re
import struct

SNIFF = 1 << 16          # bytes looked at
BINARY_SHARE = 0.01      # control bytes (NUL runs aside) above this share of the sniffed bytes: not text
_NUL_RUN = re.compile(rb"\x00{16,}")
#: control bytes text never holds (tab, LF, CR, FF, backspace and ESC are text)
_CONTROL = bytes(b for b in range(32) if b not in (8, 9, 10, 12, 13, 27)) + b"\x7f"
_DROP = bytes.maketrans(b"", b"")

#: (signature, offset, what it is, what to do instead)
SIGNATURES: tuple[tuple[bytes, int, str, str], ...] = (
    (b"PK\x03\x04", 0, "a zip archive", ""),
    (b"PK\x05\x06", 0, "an empty zip archive", ""),
    (b"\x93NUMPY", 0, "a numpy array file (.npy)", ""),
    (b"\x89HDF\r\n\x1a\n", 0, "an HDF5 file (Keras .h5 weights, a dataset)", ""),
    (b"BZh", 0, "a bzip2-compressed file", "decompress it first: bzcat FILE | torchdoctor logs -"),
    (b"\xfd7zXZ\x00", 0, "an xz-compressed file", "decompress it first: xzcat FILE | torchdoctor logs -"),
    (b"\x28\xb5\x2f\xfd", 0, "a zstd-compressed file", "decompress it first: zstdcat FILE | torchdoctor logs -"),
    (b"7z\xbc\xaf\x27\x1c", 0, "a 7-zip archive", "extract the log from it first"),
    (b"\x7fELF", 0, "an ELF executable or shared library", ""),
    (b"\x89PNG\r\n\x1a\n", 0, "a PNG image", ""),
    (b"\xff\xd8\xff", 0, "a JPEG image", ""),
    (b"GGUF", 0, "a GGUF model file", ""),
    (b"ustar", 257, "a tar archive", "extract the log from it first: tar -xOf FILE PATH/TO/LOG | torchdoctor logs -"),
)


def _zip_kind(head: bytes) -> str:
    """What a zip holds, from its first entry names: torch.save's archive keeps ``<name>/data.pkl``."""
    if b"data.pkl" in head[:4096] or b"/data/0" in head[:4096]:
        return "a PyTorch checkpoint (torch.save's zip archive, with data.pkl inside)"
    return "a zip archive"


def _safetensors(head: bytes) -> bool:
    if len(head) < 10:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= 100 * 2**20 and head[8:9] == b"{" and head[9:10] in b'"}'


def _pickle(head: bytes) -> str | None:
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        if head[2:3] == b"\x8a" and head[3:4] == b"\x0a":  # torch.save's legacy magic number, a 10-byte long
            return "a PyTorch checkpoint in torch.save's legacy (pickle) format"
        return ("a pickle (torch.save's legacy format, pickle.dump, a Flight Recorder dump: for those, pass the "
                "folder of dumps)")
    return None


def not_text(head: bytes, *, gzipped: bool = False) -> str | None:
    """Why the stream starting with ``head`` is not a text log (a sentence naming what it is and what to pass), or
    None for text. ``gzipped``: ``head`` is what a gzip file decompressed to."""
    if not head:
        return None
    what, todo = None, ""
    for sig, off, name, hint in SIGNATURES:
        if head[off: off + len(sig)] == sig:
            what, todo = (_zip_kind(head) if sig.startswith(b"PK\x03") else name), hint
            break
    if what is None:
        what = _pickle(head)
    if what is None and _safetensors(head):
        what = "a safetensors file (model weights)"
    if what is None:
        if head.startswith((b"\xff\xfe", b"\xfe\xff")) or _utf16(head):
            return None
        body = _NUL_RUN.sub(b"", head)  # a hole of zeros (a crash before the file's blocks were written) says nothing
        bad = len(body) - len(body.translate(_DROP, _CONTROL))
        if bad <= max(2, BINARY_SHARE * len(body)):
            return None
        what = (f"binary data ({bad} control bytes in its first {len(head):,}; a text log has none but tab, "
                "newline and colour codes)")
    inside = "gzip-compressed, and what it holds is " if gzipped else ""
    tail = f"; {todo}" if todo else "; pass the log the run printed (its stdout/stderr, a .log or .txt file)"
    return f"not a text log: {inside}{what}{tail}"


def _utf16(head: bytes) -> bool:
    even, odd = head[0::2], head[1::2]
    if len(head) < 4:
        return False
    return (odd.count(0) > 0.4 * len(odd) and even.count(0) < 0.1 * len(even)) or (
        even.count(0) > 0.4 * len(even) and odd.count(0) < 0.1 * len(odd))


class NotText(OSError):
    """The input is not a text log (:func:`not_text` says what it is). An ``OSError``, so a caller that reports
    unreadable inputs in one line reports this one the same way."""

    def __init__(self, why: str) -> None:
        super().__init__(0, why)
