"""A faithful re-implementation of SGLang's NGRAM worker (the `sglang` drafter preset)."""
