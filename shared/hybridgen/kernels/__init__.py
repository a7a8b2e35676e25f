"""Triton kernels and their torch references (reference.py), dispatched by ops.py.

A kernel's arguments that change from step to step (the batch's block-table width, the
number of decode splits, a GEMM's token count, the offsets of index tables packed into one
upload) are declared `do_not_specialize` / `do_not_specialize_on_alignment`, so that
serving never meets a new compile mid-run (~0.5-1 s a compile on an H100); only constexprs
pick variants. tests/test_kernel_compiles.py checks it at the shapes a server meets.
"""
