"""Helpers for testing code that uses nxdi: hypothesis strategies (`nxdi.testing.strategies`), tiny
random Hugging Face checkpoints (`checkpoints`), brief training for accuracy tests and trained
target/draft pairs for speculation (`training`), and a word-level tokenizer (`word_tokenizer`)."""
