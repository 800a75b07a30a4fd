"""gguf.GGUFReader with fast metadata arrays.

GGUFReader builds one memory-mapped numpy view per array element while it opens a file (two per string:
its length and its bytes). A tokenizer's metadata holds three arrays the length of the vocabulary, so
opening SmolLM2's GGUF (49k tokens) took 7-11 s and Gemma 3's (262k) 28-31 s on a 2-core machine, every
time a process opened it. This subclass reads long arrays from a plain (non-memmap) ndarray view of the
same mapping with `struct`, which builds the same fields (the same `parts`, `data` and `types`, so
`ReaderField.contents()` and every caller work unchanged) in well under a second. Short fields, byte-swapped
files and tensors are the base class's.

Before the base class maps the tensors, each tensor's table entry is checked (a known ggml type, rows of
whole blocks, data inside the file), so a truncated or corrupt file fails with GGUFError naming the file
and the tensor instead of a numpy reshape error from inside gguf.
"""

from __future__ import annotations

import math
import struct

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

_SCALARS = {t: np.dtype(d) for t, d in GGUFReader.gguf_scalar_to_np.items()}
_LONG = 64  # arrays shorter than this go through the base class (nothing to win)


class GGUFError(ValueError):
    """A GGUF file that cannot be read: truncated, corrupt, or not a GGUF file."""


class FastGGUFReader(GGUFReader):
    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        where = getattr(self.data, "filename", None) or "GGUF file"
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            type_id = int(raw_dtype[0])
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise GGUFError(f"{where}: tensor {name!r} has ggml type id {type_id}, which no GGUF type has "
                                "(a corrupt file, or a type newer than this gguf package)") from None
            ne = [int(d) for d in dims]
            block, type_size = GGML_QUANT_SIZES[qtype]
            if any(d < 0 for d in ne) or (ne and ne[0] % block):
                raise GGUFError(f"{where}: tensor {name!r} ({qtype.name}) has ggml shape {ne}: rows are not whole "
                                f"{qtype.name} blocks of {block} values (a corrupt tensor table)")
            start = start_offs + int(offset_tensor[0])
            end = start + math.prod(ne) // block * type_size
            if end > size:
                raise GGUFError(f"{where}: tensor {name!r} ({qtype.name} {ne}) lies at bytes {start}..{end}, past "
                                f"the end of the file ({size} bytes): the file is truncated (an interrupted "
                                "download?)")
        super()._build_tensors(start_offs, fields)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if int(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        buf = self._buffer()
        item_type, count = struct.unpack_from("<IQ", buf, orig_offs)
        if count < _LONG or (item_type != GGUFValueType.STRING and GGUFValueType(item_type) not in _SCALARS):
            return super()._get_field_parts(orig_offs, raw_type)
        base = self._plain
        offs = orig_offs + 12
        parts = [base[orig_offs:orig_offs + 4].view(np.uint32), base[orig_offs + 4:offs].view(np.uint64)]
        types = [GGUFValueType.ARRAY, GGUFValueType(item_type)]
        if item_type == GGUFValueType.STRING:
            lens = []
            for _ in range(count):  # the lengths first (struct on the buffer: ~0.2 us each)
                (n,) = struct.unpack_from("<Q", buf, offs)
                lens.append((offs, n))
                offs += 8 + n
            for o, n in lens:
                parts.append(base[o:o + 8].view(np.uint64))
                parts.append(base[o + 8:o + 8 + n])
            data = list(range(3, 2 + 2 * count + 1, 2))
        else:
            dt = _SCALARS[GGUFValueType(item_type)]
            arr = base[offs:offs + dt.itemsize * count].view(dt)
            parts += [arr[i:i + 1] for i in range(count)]
            data = list(range(2, 2 + count))
            offs += dt.itemsize * count
        return offs - orig_offs, parts, data, types

    def _buffer(self):
        if getattr(self, "_buf", None) is None:
            self._plain = self.data.view(np.ndarray)  # slicing a plain ndarray skips memmap's bookkeeping
            self._buf = memoryview(self._plain)
        return self._buf
