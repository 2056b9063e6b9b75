"""Helpers for testing code that uses nxdi: hypothesis strategies (`nxdi.testing.strategies`), tiny
random Hugging Face checkpoints (`checkpoints`), brief training for accuracy tests and trained
target/draft pairs for speculation (`training`), a word-level tokenizer (`word_tokenizer`), Medusa
heads: a reference module, their `medusa_heads.pt` file and brief training (`medusa`), and an EAGLE
draft: a reference module, its checkpoint and brief training (`eagle`)."""
