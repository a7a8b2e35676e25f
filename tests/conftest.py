"""Shared test setup.

Triton kernels run on the CPU through Triton's interpreter when no GPU is present, so CI
covers them numerically. The variable must be set before any kernel module is imported.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
