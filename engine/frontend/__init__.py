"""The engine's front end: AsyncLLM (the server's), LLMEngine (the offline LLM's), tokenization off the
event loop, incremental detokenization and stop strings, the model's generation defaults.

Runs in the API process (or in-process with the offline `LLM`). May import core/ (the client and the wire
types), model/ (the tokenizer) and the top-level leaves; never worker/ or anything that runs the model.
"""
