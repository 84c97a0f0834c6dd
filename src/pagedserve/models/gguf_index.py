"""A GGUF file's metadata and tensor places, parsed once and then read from a small saved index.

gguf's GGUFReader parses every metadata field at once, a vocabulary's strings and merges one by
one: ~2 s of a start for the default model's 49,152 tokens (and transformers' tokenizer is
cached separately). What loading needs is the config's fields and where each tensor's bytes
are; the index keeps those (JSON, beside the tokenizer's copy in file_cache) and later starts
map the tensors' bytes straight from the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from pagedserve.models import file_cache

# Metadata arrays longer than this (a vocabulary, its merges) are kept by their length only.
ARRAY_MAX = 64
FORMAT = 1  # of the saved index: another number is parsed afresh


@dataclass
class IndexedTensor:
    name: str
    tensor_type: int  # GGMLQuantizationType
    shape: list[int]  # GGUF's order, innermost dimension first
    offset: int  # of its data in the file
    dtype: str  # numpy dtype and shape of the data as GGUFReader views it: blocks as
    data_shape: list[int]  # uint8 [rows, bytes per row], float types element by element

    def data(self, file: np.ndarray) -> np.ndarray:
        """This tensor's bytes in `file` (the whole file, memory-mapped), as GGUFReader's."""
        dtype = np.dtype(self.dtype)
        size = int(np.prod(self.data_shape)) * dtype.itemsize
        return file[self.offset : self.offset + size].view(dtype).reshape(self.data_shape)


@dataclass
class GGUFIndex:
    fields: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: list[IndexedTensor]
    format: int = FORMAT

    @classmethod
    def parse(cls, path: str) -> GGUFIndex:
        reader = GGUFReader(path)
        fields, lengths = {}, {}
        for key, f in reader.fields.items():
            if f.types and f.types[0] == GGUFValueType.ARRAY:
                lengths[key] = len(f.data)
                if len(f.data) > ARRAY_MAX:
                    continue
            fields[key] = f.contents()
        tensors = [
            IndexedTensor(
                t.name,
                int(t.tensor_type),
                [int(d) for d in t.shape],
                int(t.data_offset),
                t.data.dtype.str,
                list(t.data.shape),
            )
            for t in reader.tensors
        ]
        return cls(fields, lengths, tensors)

    @classmethod
    def load(cls, path: str) -> GGUFIndex:
        """The file's index: the saved one, or a parse (then saved for later starts)."""
        saved = file_cache.cache_path(path, "gguf-index", os.path.basename(path)) + ".json"
        try:
            with open(saved) as f:
                raw = json.load(f)
            if raw.get("format") == FORMAT:
                raw["tensors"] = [IndexedTensor(**t) for t in raw["tensors"]]
                return cls(**raw)
        except (OSError, ValueError, TypeError):
            pass  # none yet, or unreadable: parse the file
        index = cls.parse(path)
        text = json.dumps(asdict(index))

        def write(partial: str) -> None:
            with open(partial, "w") as f:
                f.write(text)

        file_cache.save(saved, write)
        return index

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)
