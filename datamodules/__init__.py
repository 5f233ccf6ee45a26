"""Data components of zlightning, imported as ``zlightning.datamodules``.

`TextCorpusDataModule` trains byte-level language models on a real corpus that exists on every machine (the Python
standard library's source) or on any directory of text files; `PackedByteDataset` packs documents into fixed-length
next-token samples and keeps the document boundaries.
"""

from .text import BYTE_VOCAB_SIZE, PackedByteDataset, TextCorpusDataModule, corpus_files

__all__ = ["BYTE_VOCAB_SIZE", "PackedByteDataset", "TextCorpusDataModule", "corpus_files"]
