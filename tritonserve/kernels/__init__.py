"""The engine's hot-path kernels, one folder per backend, both tested against one oracle:
triton/ (GPU kernels; on CPU tensors under TRITON_INTERPRET=1, as the tests run them), cpu/
(the C++ library for x86-64 CPUs with its Python loader and op table), reference.py (plain
torch with the same contracts). engine/models/ops.py picks among them per device."""
