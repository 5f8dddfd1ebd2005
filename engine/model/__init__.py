"""Where a model comes from and how its files become weights: sources (hf://, pvc://, file://, bundled),
resolution to a local folder, GGUF conversion and its cache, the tokenizer, the loader, per-rank sharding,
and the on-disk cache of weight codes.

Runs wherever a model is resolved (API process: no torch there, see tokenizer.py and resolve.py) or loaded
(every rank: loader.py). May import models/, layers/, distributed/ and the top-level leaves.
"""
