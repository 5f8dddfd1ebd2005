"""Structured outputs with xgrammar: `grammar.py` compiles specs (the API process validates with it before
admission), `manager.py` is the engine core's side (compile off the loop, a matcher per sequence).
May import model/ (the tokenizer) and the top-level leaves.
"""
