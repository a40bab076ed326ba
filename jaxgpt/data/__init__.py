"""Data: corpora -> tokenizers -> cached token bins -> a resumable, process-sliced batch sampler."""

from jaxgpt.data.bins import Dataset, load_prepared, prepare_dataset
from jaxgpt.data.corpora import CORPORA, default_cache_dir, get_corpus
from jaxgpt.data.sampler import BatchSampler, DocumentSampler, Prefetcher, document_ids, document_starts
from jaxgpt.data.tokenizer import (
    TOKENIZERS,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    get_tokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_difference,
    tokenizer_fingerprint,
    tokenizer_from_dict,
)

__all__ = [
    "CORPORA",
    "TOKENIZERS",
    "BPETokenizer",
    "BatchSampler",
    "ByteTokenizer",
    "CharTokenizer",
    "Dataset",
    "DocumentSampler",
    "GPT2Tokenizer",
    "Prefetcher",
    "Tokenizer",
    "default_cache_dir",
    "document_ids",
    "document_starts",
    "get_corpus",
    "get_tokenizer",
    "load_prepared",
    "load_tokenizer",
    "prepare_dataset",
    "save_tokenizer",
    "tokenizer_difference",
    "tokenizer_fingerprint",
    "tokenizer_from_dict",
]
