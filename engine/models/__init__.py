"""Model implementations (the Llama family) built from layers/; `llama_cpu_decoder.py` runs a bf16 CPU
step's layers in one C++ call. Runs in every rank. May import layers/, distributed/, tokenmill.kernels and
the top-level leaves."""
