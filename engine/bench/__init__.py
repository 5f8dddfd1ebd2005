"""Benchmarks (`tokenmill bench ...`, docs/benchmarks.md): they drive the engine the way users do (the
offline LLM, a real server, peers' servers) and may import any engine package; nothing imports bench/."""
