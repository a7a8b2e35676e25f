"""y = x @ dequant(W).T (+ bias) for a dense layer's int8 / int4 weight (Triton), decode and
prefill alike: models/dense_quant.py's formats.

Two kernels per format (int4 has a second GEMV, below), all reading the codes once per
program and dequantizing in registers in fp32 (int8 `q * s`, int4 `code * s + z`):

GEMV (decode, one row of x: `Tiles.block_m == 1`): grid (cdiv(N, BLOCK_N), T, SPLIT). At
batch 1 a projection's time is its weight's bytes over the memory bandwidth, so the work is
spread over many small programs: BLOCK_N = 8 rows gives llama3-8b's narrowest projections
(o_proj, down_proj: N = 4096) 512 programs, ~4 per SM of the H200's 132, and each streams
its rows along K in [BLOCK_N, BLOCK_K / 2]-byte tiles with no tl.dot: multiply by x and
add into a [BLOCK_N, runs, 16] fp32 accumulator, summed once at the end. The old kernel
(BLOCK_M = 16 tl.dot, BLOCK_N = 64) gave N = 4096 only 64 programs, each looping serially
over all of K (112 iterations for down_proj), and gathered a scale and a zero per weight:
52 ms a decode step for ~4.5 GB of int4 weights (~90 GB/s).

int4 word GEMV (`_int4_gemv_words`, the default at T = 1 for bf16 activations; `Tiles.words`):
the byte GEMV above is ~10 instructions a weight, compiled for sm_90 by the H200's Triton
3.6 (636 in the loop for a thread's 64 weights; 8.3 with Triton 3.9: a byte to int32, the
nibble's and/shift, or with 2^23, subtract, scale FMA, zero add, x FMA, and x through shared
memory with 16 barriers an iteration), so its llama3-8b step took bf16 cuBLAS's 3.89 ms
(1.0 TB/s). The word kernel is ~4.8 (1,222 for 256 weights; 4.3 with Triton 3.9; `ptxas`
for sm_90 run offline, no GPU):
1. Scale and zero once per run, not per weight: a group is a whole number of 32-input runs,
   and sum_j (c_j s + z) x_j = s * sum_j c_j x_j + z * sum_j x_j. A run's sum c x is one
   FMA a weight; s and z apply once per row and run; sum x once per run, for all the rows.
2. Codes as 32-bit words: a run is 4 words (one 16-byte load a row), word w's byte j holding
   inputs 4w + j (low nibble) and 16 + 4w + j (high), i.e. nibble i = 2j + p is input
   16p + 4w + j. Each 16-bit half, put under 2^23's exponent bits once per word, gives
   nibble Q (of 4) as a float with one AND: (u & (2^23 bits | 15 << 4Q)) = 2^23 + c * 16^Q
   exactly, and c = that * 16^-Q - 2^23 * 16^-Q is one FMA rounding an exact value. A
   weight is AND, FMA (FADD for Q = 0), FMA with x: 3 instructions; a word 2 more (its
   halves: an AND-OR and a LEA.HI); a row and run ~9 (3 adds of the words' sums, s and z
   loads and conversions, 2 FMAs); a run of x ~70 (4 loads, 32 bf16 conversions, 31
   adds), shared by the BLOCK_N rows. 2^23's bits and 2^23 come as arguments (`MAGIC`,
   `two23`) where an AND or FMA needs a second constant: as immediates, ptxas moved them
   back into registers before most of those instructions (~100 MOVs a 256 weights).
3. Bytes in flight: the tile is [BLOCK_N = 8, runs, 4] words, one run a thread (its x in the
   same layout: x read as int32 pairs in four 16-byte chunks, rearranged in registers by
   split / join / permute, no shared memory), 2 warps along K (BLOCK_K = 2048). The words
   load as a flat [BLOCK_N, 4 runs] tile: as [BLOCK_N, runs, 4], Triton 3.6 spread the rows
   over threads instead and moved x through shared memory. Each thread has 128 bytes of
   codes in flight an iteration (the byte kernel 32), a program 8 KB: at 128 registers 8
   programs fit an SM (64 KB; the byte kernel ~20 KB). N / 8 programs: llama3-8b's
   narrowest projections (N = 4096) have 512, ~4 an SM (32 KB in flight, 2x the byte
   kernel's), so they do not split K; narrower ones split as below.
Expected (not yet measured): at the byte kernel's issue efficiency (3.89 ms for 10 a weight),
4.8 a weight is ~1.9 ms a step; with no barriers and 2-3x the bytes in flight, nearer the
~1.0 ms that 4.2 GB of int4 weights take at 4.2 TB/s. 16 rows a thread is ~0.2 fewer a weight
but takes 168-255 registers (Triton 3.6-3.9); bench/dense_quant_bench.py times it as `new16`.

int4 tensor-core GEMV (`_int4_gemv_mma`, `Tiles.mma`, `MMA_GEMV_TILES`; not the default:
models.dense_quant.choose_gemv times it against the word GEMV at load and gives each
projection shape the faster, `GEMV_CANDIDATES`): the word kernel is issue-bound (4.8
instructions a weight), this one ~3.0 (Triton 3.6 for sm_90, `ptxas` offline;
bench/NOTES.md). Each 16-bit half of a word, masked to one nibble and or'ed with bf16
128.0's bits, is the bf16 128 + code: two weights an AND-OR, four shifts and masks a word.
The [64 rows, 512] tile of them is wgmma's A operand; B is x's block diagonal [512, 16]
(column g holds the tile's group g's inputs, at most 16 groups), so one dot gives every
row's and group's sum of (128 + code) x, and the scale and zero apply once per row and
group: s d + (z - 128 s) sum x (the 128 s sum x terms cancel to ~1e-5 of s sum x in fp32).
The codes load two steps ahead (cp.async).

int4 int8-activation GEMV (`_int4_gemv_dp4a`, `Tiles.dp4a`, `DP4A_GEMV_TILES`; a
choose_gemv candidate): the word GEMV's layout and threads, but each 32-input run of x is
rounded to int8 in registers (scale max |x| / 127, as llama.cpp's Q8_1 matvec does) and the
codes meet it as bytes: a word's low nibbles (w & 0x0F0F0F0F) are four codes in the order of
x's inputs 4w..4w + 3, its high nibbles those of 16 + 4w.., so one DP4A (four byte products
added to an int32) takes four weights, and s * d * sum(c q) + z * sum(x) closes each row and
run (d = max |x| / 127; the zero's sum of x is x's own). ~2.4 instructions a weight at 8 rows
a thread with Triton 3.9 for sm_90 offline (`ptxas` + `nvdisasm`), against the word GEMV's
4.3 there: the codes cost 5 a word (an AND, a shift and an AND, two DP4As), the run of x ~170
shared by the rows. Each tile's codes and x load a loop step ahead. On the H100 a llama3-8b
step's projections take 1.98 ms against the word GEMV's 2.28 (`bench/dense_quant_bench.py`).
A run's 127 / max |x| is an IEEE quotient, as torch divides in the reference (Triton's own
fp32 division is div.full, ~2 ulp off). div.rn itself (f3a0030) cost B1 int4 ~4 % on an H100
(368 -> 354 tok/s, `bench/ab_commits.sh`): a range check, a branch and a slow-path call in the
loop. `_div_127` is its fast path alone (the range check always passes here), untimed.
The error this adds is x's rounding, at most d / 2 an input
(kernels/reference.py `int8_runs` is the same rounding in torch). Under Triton's interpreter
DP4A is the same integer sum from shifts (`_dp4a`; the inline PTX runs on the device only).

Epilogues of the word and int8-activation GEMVs of one K slice (`EPILOGUE`), each taking a
small kernel's place after the projection (a graph node a layer fewer each) and computing
what that kernel computes from the projection's output in x's dtype, to the same bits. A
program's rows then come in pairs, alternating (`_gemv_rows`):
- SWIGLU (`quant_linear(swiglu=True)`, the MLP's fused [gate | up]): gate row i and up row
  i; it writes silu(gate) * up as triton_activation's kernel does.
- ROPE (`quant_linear(rope=RopeWrite)`, the fused qkv): a head's rows d and d + D / 2; it
  rotates q and k as triton_rope_cache's kernel does, writes q, and k and v into the
  native cache at the token's slot.
Other tiles and split K run those kernels after the projection. Compiled for sm_90 offline
(Triton 3.9): the loop is unchanged, the epilogue adds 48 (SWIGLU) and 320 (ROPE)
instructions a program; not yet timed on a GPU.

GEMM (several rows: `block_m >= 16`): grid (cdiv(N, BLOCK_N), cdiv(T, BLOCK_M), SPLIT); each
weight tile is dequantized to x's dtype once per BLOCK_M rows and multiplied on the tensor
cores (tl.dot, fp32 accumulation). A 512-token prefill in BLOCK_M = 128 re-reads the weights
4 times (2.3 GB of int4 reads per 8B-model forward, under a ms), against 32 with the old
BLOCK_M = 16. It was expected to run at the tensor cores' pace; it ran at ~150 TFLOP/s, so it
now serves from 16 to DEQUANT_MIN_ROWS - 1 rows (decode batches, short chunks) and prefill
takes the path below.

Prefill (`DEQUANT_MIN_ROWS` rows of x or more, default tiles): the fused GEMM measured
~150 TFLOP/s on the H200 (a 512-token llama3-8b forward 55.8 ms int4, 28.7 int8, against
10.3 ms bf16: `bench/results/served/dense_quant_table_2082a57.txt`), so there the weight is
dequantized to x's dtype, `DEQUANT_SLAB_BYTES` of it at a time (`_dequant`: the
GEMM's own tiles, so the same rounded values), and multiplied by torch (cuBLAS). The
extra traffic is 2 bytes written and read a weight, ~5 ms a forward at that size.
Expected (not yet measured): ~15 ms against 55.8.

Split-K: a grid under one program per SM (`sm_count`, the device's, cached) splits K into
SPLIT slices of whole tiles (never shorter than MIN_SPLIT_TILES tiles) so that about
2 x SMs programs run; the slices write fp32 partials [SPLIT, T, N], summed after in a fixed
order (deterministic; graph-capturable: no host sync, shapes from the arguments only). A
whole grid does not split: two more kernels (sum, cast) would cost more than a few-us
projection gains.

Layouts: int4 byte j of a 32-input run holds inputs j (low nibble) and j + 16 (high), so a
tile is loaded as [BLOCK_N, runs, 16] bytes and its low and high nibbles meet x's two
halves of each run, with no shuffle of the codes. Scales (and zeros) are loaded once per
run, [BLOCK_N, runs], and broadcast over its inputs (a group is a whole number of runs).
Codes become floats exactly without the slow int -> float conversion: a code c in 0..255
or'ed into the bits of 2^23 is the float 2^23 + c (int4: c = the nibble; int8: c = q + 128).
fp32 activations multiply in IEEE fp32 (no TF32), so the CPU interpreter and a float64
reference agree to fp32 rounding.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import libdevice

from hybridgen.kernels import triton_activation, triton_rope_cache
from hybridgen.kernels.exact_float import byte_float, int8_float
from hybridgen.kernels.rope_write import RopeWrite
from hybridgen.kernels.split_counters import counters

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Running in Triton's CPU interpreter (the tests without a GPU)."""
DEFAULT_SMS = 132
"""SMs assumed off CUDA (the interpreter): the H200's, so the CPU tests split as it does."""
MIN_SPLIT_TILES = 2
"""Fewest K tiles in one split-K slice."""
SHARED_MEMORY_BYTES = 232_448
"""Shared memory one program may use on the H100/H200 (Triton's limit there); the GEMM's
pipeline stages must fit it."""
TWO_23 = 8388608.0
"""2^23: the float whose low mantissa bits an int in 0..255 fills exactly."""


DEQUANT_MIN_ROWS = 128
"""Rows of x from which quant_linear dequantizes and calls torch's GEMM (module docstring)."""
DEQUANT_SLAB_BYTES = 64 << 20
"""Most bytes of dequantized weight a prefill holds at once (rows of the weight in x's
dtype; the engine's start-up measures the step's peak with it)."""
DEQUANT_TILES = (32, 256)
"""(rows, inputs) of the weight one dequantizing program writes."""

MAGIC = 0x4B000000
"""The bits of 2^23: or'ed over code bits 0..22 it makes the float 2^23 + those bits."""


@dataclass(frozen=True)
class Tiles:
    """One launch's tile sizes and shape."""

    block_m: int
    """Rows of x per program: 1 is the GEMV (no tl.dot), >= 16 the tensor-core GEMM."""
    block_n: int
    """Weight rows (outputs) per program."""
    block_k: int
    """Inputs per K step, a multiple of 32 (one run)."""
    num_warps: int
    num_stages: int
    split: int | None = None
    """K slices; None: `split_k` picks by the grid and the device's SMs."""
    words: bool = False
    """int4 GEMV only: the word kernel (`_int4_gemv_words`, bf16 activations) instead of the
    byte kernel (`_int4_gemv`)."""
    mma: bool = False
    """int4 GEMV only: the tensor-core kernel (`_int4_gemv_mma`, bf16 activations)."""
    dp4a: bool = False
    """int4 GEMV only: the int8-activation kernel (`_int4_gemv_dp4a`, bf16 activations)."""


def tiles_for(t: int, fmt: str, x_bytes: int = 2, bf16: bool = False) -> Tiles:
    """The default tiles for `t` rows of x of `x_bytes` bytes a value (`bf16`: x is
    bfloat16, which int4's word GEMV takes; see the module docstring), with as many pipeline
    stages (at most 3) as shared memory holds: fp32 activations in 128-row tiles take two."""
    if t == 1 and fmt == "int4" and bf16:
        return WORD_GEMV_TILES
    if t == 1:
        return Tiles(1, 8, 1024 if fmt == "int4" else 512, 4, 3)
    if t <= 16:
        tiles = Tiles(16, 16, 256, 4, 3)
    elif t <= 64:
        tiles = Tiles(64, 64, 128, 4, 3)
    else:
        tiles = Tiles(128, 128, 128, 8, 3)
    while tiles.num_stages > 1 and stage_bytes(tiles, fmt, x_bytes) * tiles.num_stages > (
        SHARED_MEMORY_BYTES
    ):
        tiles = replace(tiles, num_stages=tiles.num_stages - 1)
    return tiles


WORD_GEMV_TILES = Tiles(1, 8, 2048, 2, 1, words=True)
"""The word GEMV's tiles: 8 rows a thread, 2 warps along K (64 runs, one a thread)."""
MMA_GEMV_TILES = Tiles(1, 64, 512, 4, 2, mma=True)
"""The tensor-core GEMV's tiles: wgmma's 64 rows, 512 inputs (at most 16 groups) a step, the
codes two steps ahead."""
DP4A_GEMV_TILES = Tiles(1, 8, 2048, 2, 1, dp4a=True)
"""The int8-activation GEMV's tiles: the word GEMV's (8 rows a thread, a run a thread)."""
GEMV_CANDIDATES = {"words": WORD_GEMV_TILES, "mma": MMA_GEMV_TILES, "dp4a": DP4A_GEMV_TILES}
"""The int4 one-row kernels for bf16 activations that models.dense_quant.choose_gemv times
at load, per projection shape: the word GEMV (the default), the tensor-core GEMV and the
int8-activation GEMV."""


def gemv_fits(tiles: Tiles, group: int) -> bool:
    """Whether `tiles`' kernel takes int4 groups of `group` inputs (the tensor-core GEMV:
    whole groups a tile, at most 16, or whole tiles a group)."""
    if not tiles.mma:
        return True
    if tiles.block_k % group == 0:
        return tiles.block_k // group <= 16
    return group % tiles.block_k == 0


PLAIN, SWIGLU, ROPE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
"""The one-row int4 kernels' epilogues (`EPILOGUE`): y as it is; silu(gate) * up of a fused
gate_up; RoPE of a fused qkv with k and v written to the cache (module docstring)."""

ROUND_MAGIC = 12582912.0
"""1.5 * 2^23: v + it is exact for |v| < 2^22 and rounds v to an integer in its low bits."""


MMA_MASK, MMA_MAGIC = 0x000F000F, 0x43004300
"""Nibble 0 of each 16-bit half, and the bf16 128.0 twice: (w & MASK) | MAGIC is two bf16s
128 + code."""


def stage_bytes(tiles: Tiles, fmt: str, x_bytes: int) -> int:
    """Shared memory one pipeline stage of the GEMM holds (an upper bound): its x tile and its
    codes tile, plus the scales and zeros of the tile's runs."""
    codes = tiles.block_n * tiles.block_k // (1 if fmt == "int8" else 2)
    params = tiles.block_n * (tiles.block_k // 32) * 4 * 2
    return tiles.block_m * tiles.block_k * x_bytes + codes + params


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's SMs (cached), DEFAULT_SMS off CUDA."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def split_k(programs: int, k: int, block_k: int, sms: int) -> int:
    """K slices for a grid of `programs`: 1 with at least one program per SM, else enough for
    ~2 per SM, each slice at least MIN_SPLIT_TILES tiles long."""
    if programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), k // (MIN_SPLIT_TILES * block_k)))


@triton.jit
def _int4_tile(
    q_ptr, s_ptr, z_ptr, rows, stride_q, stride_s, k0, K, RUNS_PER_GROUP, BLOCK_K: tl.constexpr
):
    # -> (lo, hi) fp32 [BLOCK_N, runs, 16]: the weights of inputs k0 + 32r + j and
    # k0 + 32r + 16 + j of `rows` (int64, in range); 0 past K.
    r = tl.arange(0, BLOCK_K // 32)
    j = tl.arange(0, 16)
    run = k0 // 32 + r
    run_ok = 32 * run < K
    codes = tl.load(
        q_ptr + rows[:, None, None] * stride_q + (16 * run)[None, :, None] + j[None, None, :],
        mask=run_ok[None, :, None],
        other=0,
        eviction_policy="evict_first",
    ).to(tl.int32)
    g = rows[:, None] * stride_s + (run // RUNS_PER_GROUP)[None, :]
    s = tl.load(s_ptr + g, mask=run_ok[None, :], other=0.0).to(tl.float32)[:, :, None]
    z = tl.load(z_ptr + g, mask=run_ok[None, :], other=0.0).to(tl.float32)[:, :, None]
    return byte_float(codes & 15) * s + z, byte_float(codes >> 4) * s + z


@triton.jit
def _int8_tile(
    q_ptr, s_ptr, rows, stride_q, stride_s, k0, K, RUNS_PER_GROUP, BLOCK_K: tl.constexpr
):
    # -> fp32 [BLOCK_N, runs, 32]: the weights of inputs k0 + 32r + j of `rows`; 0 past K.
    r = tl.arange(0, BLOCK_K // 32)
    j = tl.arange(0, 32)
    run = k0 // 32 + r
    run_ok = 32 * run < K
    q = tl.load(
        q_ptr + rows[:, None, None] * stride_q + (32 * run)[None, :, None] + j[None, None, :],
        mask=run_ok[None, :, None],
        other=0,
        eviction_policy="evict_first",
    ).to(tl.int32)
    g = rows[:, None] * stride_s + (run // RUNS_PER_GROUP)[None, :]
    s = tl.load(s_ptr + g, mask=run_ok[None, :], other=0.0).to(tl.float32)[:, :, None]
    return int8_float(q) * s


@triton.jit
def _store(y_ptr, b_ptr, acc, rm, rn, T, N, HAS_BIAS: tl.constexpr):
    # acc [BLOCK_M, BLOCK_N] fp32 of rows rm, outputs rn, K slice program_id(2): into y (one
    # slice) or its fp32 partials [SPLIT, T, N]; the bias once, with slice 0.
    split = tl.program_id(2)
    n_ok = rn < N
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        acc += (bias * (split == 0).to(tl.float32))[None, :]
    out = y_ptr + (split * T + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rm < T)[:, None] & n_ok[None, :])


@triton.jit
def _gemv_rows(N, half, BLOCK_N: tl.constexpr, EPILOGUE: tl.constexpr):
    # (outputs, weight rows) [BLOCK_N] of this program; outputs past the end re-read row 0.
    # SWIGLU and ROPE take rows in pairs, alternating, and rn is the pair's id (twice):
    # SWIGLU, of a fused [gate (N / 2 rows) | up]: gate row j and up row j; ROPE, of a fused
    # qkv of heads of 2 * half rows: a head's row d and d + half (the two halves RoPE mixes).
    i = tl.arange(0, BLOCK_N)
    if EPILOGUE == SWIGLU:
        rn = tl.program_id(0) * (BLOCK_N // 2) + i // 2
        rows = tl.where(rn < N // 2, rn + (i % 2) * (N // 2), 0)
    elif EPILOGUE == ROPE:
        rn = tl.program_id(0) * (BLOCK_N // 2) + i // 2
        at = (rn // half) * (2 * half) + rn % half + (i % 2) * half
        rows = tl.where(rn < N // 2, at, 0)
    else:
        rn = tl.program_id(0) * BLOCK_N + i
        rows = tl.where(rn < N, rn, 0)
    return rn, rows.to(tl.int64)


@triton.jit
def _gemv_store(
    y_ptr,
    b_ptr,
    y,
    t,
    rn,
    rows,
    T,
    N,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    n_q_heads,
    n_kv_heads,
    half,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    # A one-row kernel's y [BLOCK_N] fp32 of outputs rn, weight rows `rows` (_gemv_rows):
    # PLAIN into y [T, N] (or a K slice's partials); SWIGLU silu(gate) * up into y [T, N / 2];
    # ROPE q roped into y [T, n_q_heads, 2 half], k roped and v into their cache rows. Each as
    # the two-kernel path computes it from the projection's output in y's dtype (the same bits).
    if EPILOGUE == PLAIN:
        _store(y_ptr, b_ptr, y[None, :], t + tl.arange(0, 1), rn, T, N, HAS_BIAS)
    else:
        ty = y_ptr.dtype.element_ty
        if HAS_BIAS:
            y += tl.load(b_ptr + rows).to(tl.float32)
        a, b = tl.split(tl.reshape(y.to(ty).to(tl.float32), (y.shape[0] // 2, 2)))
        pair, _ = tl.split(tl.reshape(rn, (y.shape[0] // 2, 2)))
        ok = pair < N // 2
        if EPILOGUE == SWIGLU:
            act = (a / (1.0 + tl.exp(-a))).to(ty).to(tl.float32)
            tl.store(y_ptr + t.to(tl.int64) * (N // 2) + pair, (act * b).to(ty), mask=ok)
        else:
            head = pair // half
            d = pair % half
            at = tl.load(pos_ptr + t).to(tl.int64) * (2 * half) + d
            c1 = tl.load(cos_ptr + at, mask=ok, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + at + half, mask=ok, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + at, mask=ok, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + at + half, mask=ok, other=0.0).to(tl.float32)
            rotated = head < n_q_heads + n_kv_heads  # q and k; v as it is
            o1 = tl.where(rotated, a * c1 - b * s1, a).to(ty)
            o2 = tl.where(rotated, b * c2 + a * s2, b).to(ty)
            q_at = y_ptr + (t.to(tl.int64) * n_q_heads + head) * (2 * half) + d
            tl.store(q_at, o1, mask=ok & (head < n_q_heads))
            tl.store(q_at + half, o2, mask=ok & (head < n_q_heads))
            # The caches [blocks, block size, n_kv_heads, 2 half], contiguous: a slot's row.
            # Loaded once a pair: the interpreter takes no scalar in a store's mask.
            slot = tl.load(slot_ptr + t + 0 * pair).to(tl.int64)
            kv = head - n_q_heads
            row = tl.maximum(slot, 0) * n_kv_heads * (2 * half) + d
            k_ok = ok & (kv >= 0) & (kv < n_kv_heads) & (slot >= 0)
            k_at = kc_ptr + row + kv * (2 * half)
            tl.store(k_at, o1.to(kc_ptr.dtype.element_ty), mask=k_ok)
            tl.store(k_at + half, o2.to(kc_ptr.dtype.element_ty), mask=k_ok)
            v_ok = ok & (kv >= n_kv_heads) & (slot >= 0)
            v_at = vc_ptr + row + (kv - n_kv_heads) * (2 * half)
            tl.store(v_at, o1.to(vc_ptr.dtype.element_ty), mask=v_ok)
            tl.store(v_at + half, o2.to(vc_ptr.dtype.element_ty), mask=v_ok)


@triton.jit
def _int4_gemv(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    T,
    N,
    K,
    K_SPLIT,
    stride_q,
    stride_s,
    RUNS_PER_GROUP,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(rn < N, rn, 0).to(tl.int64)  # out-of-range rows re-read row 0
    t = tl.program_id(1)
    k_begin = tl.program_id(2) * K_SPLIT
    k_in = 32 * tl.arange(0, BLOCK_K // 32)[:, None] + tl.arange(0, 16)[None, :]
    x_row = x_ptr + t.to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_K // 32, 16), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        lo, hi = _int4_tile(
            q_ptr, s_ptr, z_ptr, rows, stride_q, stride_s, k0, K, RUNS_PER_GROUP, BLOCK_K
        )
        k = k0 + k_in
        x_lo = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + k + 16, mask=k < K, other=0.0).to(tl.float32)
        acc += lo * x_lo[None, :, :] + hi * x_hi[None, :, :]
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    _store(y_ptr, b_ptr, y[None, :], t + tl.arange(0, 1), rn, T, N, HAS_BIAS)


@triton.jit
def _load(ptr, ok, EVEN_K: tl.constexpr, other):
    # A tile every element of which is in range when EVEN_K (no mask: no zero fill).
    if EVEN_K:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=ok, other=other)


@triton.jit
def _x_by_word(c_lo, c_hi, B: tl.constexpr):
    # Two chunks of x [1, runs, 4] as int32 (bf16 pairs: chunk c, element e holds inputs
    # 8c + 2e and 8c + 2e + 1 of a run), chunks 2p and 2p + 1 -> [1, runs, 4] by word w:
    # the pair of inputs 16p + 4w + 2B, + 1 (word w's bytes' nibbles 4B + 2h + p, h = 0, 1).
    # In registers only: e = 2 (w % 2) + B, c = 2p + w // 2.
    e0 = tl.split(tl.reshape(c_lo, (1, c_lo.shape[1], 2, 2)))[B]
    e1 = tl.split(tl.reshape(c_hi, (1, c_hi.shape[1], 2, 2)))[B]
    pairs = tl.permute(tl.join(e0, e1), (0, 1, 3, 2))
    return tl.reshape(pairs, (1, c_lo.shape[1], 4))


@triton.jit
def _bf16_half(u, H: tl.constexpr):
    # bf16 half H of the int32 pairs u, as fp32.
    if H == 0:
        return (u << 16).to(tl.float32, bitcast=True)
    else:
        return (u & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _nibble_fma(mask, u, x, p, two23, Q: tl.constexpr):
    # p + code * x for nibble Q of u's low 16 bits (u has 2^23's exponent bits above them):
    # u & mask (2^23's bits | nibble Q) is the float 2^23 + code * 16^Q, so code is
    # f * 16^-Q - 2^23 * 16^-Q, one FMA rounding an exact value.
    f = (u & mask).to(tl.float32, bitcast=True)
    return p + (f * (1.0 / (1 << (4 * Q))) - two23 * (1.0 / (1 << (4 * Q)))) * x


@triton.jit
def _int4_gemv_words(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    T,
    N,
    K,
    K_SPLIT,
    runs_per_row,
    stride_s,
    RUNS_PER_GROUP,
    magic,
    two23,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    n_q_heads,
    n_kv_heads,
    half,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    EPILOGUE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # x bf16 [T, K]; q_ptr the codes as int32 words [N, K / 8]; see the module docstring.
    RUNS: tl.constexpr = BLOCK_K // 32
    rn, rows = _gemv_rows(N, half, BLOCK_N, EPILOGUE)
    t = tl.program_id(1)
    k_begin = tl.program_id(2) * K_SPLIT
    r = tl.arange(0, RUNS)
    w = tl.arange(0, 4)
    # Words as a flat [BLOCK_N, 4 runs] tile (contiguous along its rows, so every Triton version
    # lays it out 4 words a thread, the threads along K, as x), viewed as [BLOCK_N, runs, 4].
    words_at = rows[:, None] * (4 * runs_per_row) + tl.arange(0, 4 * RUNS)[None, :]
    x_row = x_ptr.to(tl.pointer_type(tl.int32)) + t.to(tl.int64) * (K // 2)
    acc = tl.zeros((BLOCK_N, RUNS), dtype=tl.float32)
    m0, m1, m2, m3 = magic | 15, magic | 240, magic | 3840, magic | 61440  # nibbles 0..3
    for k0 in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        run = k0 // 32 + r
        run_ok = (32 * run < K)[None, :]
        ok = run_ok[:, :, None]
        x_at = x_row + (16 * run)[None, :, None] + w[None, None, :]
        c0 = _load(x_at, ok, EVEN_K, 0)
        c1 = _load(x_at + 4, ok, EVEN_K, 0)
        u0 = _x_by_word(c0, c1, 0)  # bytes' nibbles 0 (h = 0) and 2 (h = 1), p = 0
        u1 = _x_by_word(c0, c1, 1)  # nibbles 4 and 6
        c2 = _load(x_at + 8, ok, EVEN_K, 0)
        c3 = _load(x_at + 12, ok, EVEN_K, 0)
        u2 = _x_by_word(c2, c3, 0)  # nibbles 1 and 3 (p = 1)
        u3 = _x_by_word(c2, c3, 1)  # nibbles 5 and 7
        x_sum = _bf16_half(u0, 0) + _bf16_half(u0, 1) + _bf16_half(u1, 0) + _bf16_half(u1, 1)
        x_sum += _bf16_half(u2, 0) + _bf16_half(u2, 1) + _bf16_half(u3, 0) + _bf16_half(u3, 1)
        at = q_ptr + words_at + 4 * (k0 // 32)
        at_ok = (32 * (k0 // 32 + tl.arange(0, 4 * RUNS) // 4) < K)[None, :]
        words = tl.reshape(_load(at, at_ok, EVEN_K, 0), (BLOCK_N, RUNS, 4))
        lo = (words & 0xFFFF) | magic
        # An immediate here: ptxas makes the shift and the or one LEA.HI.
        hi = (words.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True) | 0x4B000000
        p = ((lo & m0).to(tl.float32, bitcast=True) - two23) * _bf16_half(u0, 0)
        p = _nibble_fma(m1, lo, _bf16_half(u2, 0), p, two23, 1)
        p = _nibble_fma(m2, lo, _bf16_half(u0, 1), p, two23, 2)
        p = _nibble_fma(m3, lo, _bf16_half(u2, 1), p, two23, 3)
        p = _nibble_fma(m0, hi, _bf16_half(u1, 0), p, two23, 0)
        p = _nibble_fma(m1, hi, _bf16_half(u3, 0), p, two23, 1)
        p = _nibble_fma(m2, hi, _bf16_half(u1, 1), p, two23, 2)
        p = _nibble_fma(m3, hi, _bf16_half(u3, 1), p, two23, 3)
        g = rows[:, None] * stride_s + (run // RUNS_PER_GROUP)[None, :]
        s = _load(s_ptr + g, run_ok, EVEN_K, 0.0).to(tl.float32)
        z = _load(z_ptr + g, run_ok, EVEN_K, 0.0).to(tl.float32)
        acc += s * tl.sum(p, axis=2) + z * tl.sum(x_sum, axis=2)
    y = tl.sum(acc, axis=1)
    _gemv_store(
        y_ptr,
        b_ptr,
        y,
        t,
        rn,
        rows,
        T,
        N,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        kc_ptr,
        vc_ptr,
        n_q_heads,
        n_kv_heads,
        half,
        HAS_BIAS,
        EPILOGUE,
    )


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    # c + the sum over bytes j of a's byte j (unsigned) times b's byte j (signed int8):
    # one DP4A on the device; the same integers from shifts under the interpreter.
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], tl.int32, True, 1
        )
    else:
        for j in tl.static_range(4):
            c += ((a >> (8 * j)) & 255) * ((b << (24 - 8 * j)) >> 24)
        return c


@triton.jit
def _div_127(b, ASM: tl.constexpr):
    # 127 / b rounded to nearest (b > 0 normal): on the device div.rn's fast path without its
    # range check and slow-path call (a branch a loop step, ~4 % of B1 int4 on an H100): a
    # reciprocal refined once, the quotient corrected once. Correct for every b whatever the
    # reciprocal within 8 ulp (tests/test_dense_quant.py checks the steps in exact arithmetic
    # and the kernel against torch's quotient); Triton's `/` is div.full (~2 ulp off).
    if ASM:
        return tl.inline_asm_elementwise(
            """{ .reg .f32 y, e, q, r, nb;
            rcp.approx.ftz.f32 y, $1;
            neg.f32 nb, $1;
            fma.rn.f32 e, nb, y, 0f3F800000;
            fma.rn.f32 y, e, y, y;
            mul.rn.f32 q, 0f42FE0000, y;
            fma.rn.f32 r, nb, q, 0f42FE0000;
            fma.rn.f32 $0, r, y, q; }""",
            "=r,r",
            [b],
            tl.float32,
            True,
            1,
        )
    else:
        return 127.0 / b


@triton.jit
def _int8_byte(v, inv, round_magic, ASM: tl.constexpr):
    # round(v * inv) (|.| <= 127) as its two's complement byte: 1.5 * 2^23 + r is an exact
    # float whose low mantissa byte is r's. The product is rounded to fp32 first (mul.rn is
    # never fused into an FMA), as torch's round(v * inv) rounds it (reference.int8_runs).
    prod = libdevice.mul_rn(v, inv) if ASM else v * inv
    return (prod + round_magic).to(tl.int32, bitcast=True) & 255


@triton.jit
def _x_int8_words(a, b, inv, round_magic, ASM: tl.constexpr):
    # a, b [1, runs, 4] int32 by word w: the bf16 pairs of inputs 4w, 4w + 1 and 4w + 2,
    # 4w + 3 of a half-run -> word w as int8 bytes j = input 4w + j at scale 1 / inv.
    w = _int8_byte(_bf16_half(a, 0), inv, round_magic, ASM)
    w |= _int8_byte(_bf16_half(a, 1), inv, round_magic, ASM) << 8
    w |= _int8_byte(_bf16_half(b, 0), inv, round_magic, ASM) << 16
    return w | (_int8_byte(_bf16_half(b, 1), inv, round_magic, ASM) << 24)


@triton.jit
def _pairs_max_sum(a, b):
    # a, b [1, runs, 4] bf16 pairs -> (max |x|, sum x) [1, runs, 4] over their 4 inputs.
    a0, a1, b0, b1 = _bf16_half(a, 0), _bf16_half(a, 1), _bf16_half(b, 0), _bf16_half(b, 1)
    amax = tl.maximum(tl.maximum(tl.abs(a0), tl.abs(a1)), tl.maximum(tl.abs(b0), tl.abs(b1)))
    return amax, (a0 + a1) + (b0 + b1)


@triton.jit
def _dp4a_tile(words_at, x_row, k0, k_end, RUNS: tl.constexpr):
    # The tile at input k0: its codes [BLOCK_N, 4 runs] int32 (words_at: the rows' first
    # words) and x's runs as four chunks [1, runs, 4] of bf16 pairs (chunk c: inputs 8c..8c
    # + 7 of a run); zeros from k_end, the end of the slice (slices end on whole tiles or
    # at K), so a prefetch past it loads nothing.
    run = k0 // 32 + tl.arange(0, RUNS)
    x_ok = (32 * run < k_end)[None, :, None]
    x_at = x_row + (16 * run)[None, :, None] + tl.arange(0, 4)[None, None, :]
    words_ok = (32 * (k0 // 32 + tl.arange(0, 4 * RUNS) // 4) < k_end)[None, :]
    words = tl.load(words_at + 4 * (k0 // 32), mask=words_ok, other=0)
    c0 = tl.load(x_at, mask=x_ok, other=0)
    c1 = tl.load(x_at + 4, mask=x_ok, other=0)
    c2 = tl.load(x_at + 8, mask=x_ok, other=0)
    c3 = tl.load(x_at + 12, mask=x_ok, other=0)
    return words, c0, c1, c2, c3


@triton.jit
def _int4_gemv_dp4a(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    T,
    N,
    K,
    K_SPLIT,
    runs_per_row,
    stride_s,
    RUNS_PER_GROUP,
    round_magic,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    n_q_heads,
    n_kv_heads,
    half,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    ASM: tl.constexpr,
    EPILOGUE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # x bf16 [T, K]; q_ptr the codes as int32 words [N, K / 8] (the word GEMV's): a run's
    # word w holds inputs 4w + j (low nibbles) and 16 + 4w + j (high) in byte j. Each run of
    # x is quantized to int8 in registers (scale max |x| / 127), so one DP4A multiplies four
    # codes by four inputs: sum_j (c_j s + z) x_j = s d sum_j c_j q_j + z sum_j x_j.
    RUNS: tl.constexpr = BLOCK_K // 32
    rn, rows = _gemv_rows(N, half, BLOCK_N, EPILOGUE)
    t = tl.program_id(1)
    k_begin = tl.program_id(2) * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    r = tl.arange(0, RUNS)
    words_at = q_ptr + rows[:, None] * (4 * runs_per_row) + tl.arange(0, 4 * RUNS)[None, :]
    x_row = x_ptr.to(tl.pointer_type(tl.int32)) + t.to(tl.int64) * (K // 2)
    acc = tl.zeros((BLOCK_N, RUNS), dtype=tl.float32)
    # Each tile's codes and x are loaded a loop step ahead (measured on the H100: a model
    # step's projections 1.98 ms against 2.08 loading each in its own step).
    words, c0, c1, c2, c3 = _dp4a_tile(words_at, x_row, k_begin, k_end, RUNS)
    for k0 in range(k_begin, k_end, BLOCK_K):
        codes, x0, x1, x2, x3 = words, c0, c1, c2, c3  # this tile's, the loads below the next
        words, c0, c1, c2, c3 = _dp4a_tile(words_at, x_row, k0 + BLOCK_K, k_end, RUNS)
        run = k0 // 32 + r
        run_ok = (32 * run < K)[None, :]
        a_lo, b_lo = _x_by_word(x0, x1, 0), _x_by_word(x0, x1, 1)
        a_hi, b_hi = _x_by_word(x2, x3, 0), _x_by_word(x2, x3, 1)
        max_lo, sum_lo = _pairs_max_sum(a_lo, b_lo)  # inputs 0..15 of each run
        max_hi, sum_hi = _pairs_max_sum(a_hi, b_hi)  # inputs 16..31
        amax = tl.max(tl.maximum(max_lo, max_hi), axis=2)
        # A true quotient, as reference.int8_runs divides; an all-zero run: inv * 0 = 0.
        inv = _div_127(tl.maximum(amax, 1e-30), ASM)
        q_lo = _x_int8_words(a_lo, b_lo, inv[:, :, None], round_magic, ASM)
        q_hi = _x_int8_words(a_hi, b_hi, inv[:, :, None], round_magic, ASM)
        codes = tl.reshape(codes, (BLOCK_N, RUNS, 4))
        dot = _dp4a(codes & 0x0F0F0F0F, q_lo, tl.zeros_like(codes), ASM)
        dot = _dp4a((codes >> 4) & 0x0F0F0F0F, q_hi, dot, ASM)
        g = rows[:, None] * stride_s + (run // RUNS_PER_GROUP)[None, :]
        s = _load(s_ptr + g, run_ok, EVEN_K, 0.0).to(tl.float32)
        z = _load(z_ptr + g, run_ok, EVEN_K, 0.0).to(tl.float32)
        d = amax * (1.0 / 127.0)
        acc += s * d * tl.sum(dot, axis=2).to(tl.float32) + z * tl.sum(sum_lo + sum_hi, axis=2)
    y = tl.sum(acc, axis=1)
    _gemv_store(
        y_ptr,
        b_ptr,
        y,
        t,
        rn,
        rows,
        T,
        N,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        kc_ptr,
        vc_ptr,
        n_q_heads,
        n_kv_heads,
        half,
        HAS_BIAS,
        EPILOGUE,
    )


@triton.jit
def _bf16_lo(v):
    # The bf16 in v's low 16 bits.
    return v.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_hi(v):
    # The bf16 in v's high 16 bits.
    return (v >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _int4_gemv_mma(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    lock_ptr,
    T,
    N,
    K,
    K_SPLIT,
    runs_per_row,
    stride_s,
    RUNS_PER_GROUP,
    mask,
    magic,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    COLS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # x bf16 [T, K]; q_ptr the codes as int32 words [N, K / 8]; COLS the groups a tile
    # spans (at least 1: a group as long as several tiles; at most 16); UPCAST: see _dot. The
    # dequantized tile's position p is word p // 8's nibble i = 2 b + a + 4 c (a, b, c =
    # bits 2, 1, 0 of p: the joins below), i.e. input 32 run + 16 (i % 2) + 4 w + i // 2 of
    # the tile (the word layout); a group's inputs are whole runs, so contiguous in p.
    KW: tl.constexpr = BLOCK_K // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(rn < N, rn, 0).to(tl.int64)  # out-of-range rows re-read row 0
    t = tl.program_id(1)
    k_begin = tl.program_id(2) * K_SPLIT
    p = tl.arange(0, BLOCK_K)
    word = p // 8
    nibble = 2 * ((p // 2) % 2) + (p // 4) % 2 + 4 * (p % 2)
    inp = 32 * (word // 4) + 16 * (nibble % 2) + 4 * (word % 4) + nibble // 2
    cols = tl.arange(0, 16)
    in_col = (inp // (BLOCK_K // COLS))[None, :] == cols[:, None]  # [16, BLOCK_K]
    kw = tl.arange(0, KW)
    words_at = rows[:, None] * (4 * runs_per_row) + kw[None, :]
    x_row = x_ptr + t.to(tl.int64) * K
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        words = _load(q_ptr + words_at + k0 // 8, (8 * (k0 // 8 + kw) < K)[None, :], EVEN_K, 0)
        v0 = (words & mask) | magic  # nibbles 0 and 4 as the bf16s 128 + code
        v1 = ((words >> 4) & mask) | magic
        v2 = ((words >> 8) & mask) | magic
        v3 = ((words >> 12) & mask) | magic
        lo = tl.join(tl.join(_bf16_lo(v0), _bf16_lo(v1)), tl.join(_bf16_lo(v2), _bf16_lo(v3)))
        hi = tl.join(tl.join(_bf16_hi(v0), _bf16_hi(v1)), tl.join(_bf16_hi(v2), _bf16_hi(v3)))
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # 128 + code
        x = _load(x_row + k0 + inp, k0 + inp < K, EVEN_K, 0.0)
        xg = tl.where(in_col, x[None, :], 0.0).to(tl.bfloat16)  # column g: group g's x
        d = tl.trans(_dot(w, xg, UPCAST))  # [16, BLOCK_N]: each group's sum (128 + c) x
        sums = tl.sum(tl.reshape(x.to(tl.float32), (COLS, BLOCK_K // COLS)), axis=1)
        x_sum = tl.sum(
            tl.where(cols[:, None] == tl.arange(0, COLS)[None, :], sums[None, :], 0.0), 1
        )
        g = (k0 // 32) // RUNS_PER_GROUP + cols
        g_ok = (cols < COLS) & (g < stride_s)
        at = rows[None, :] * stride_s + g[:, None]
        s = tl.load(s_ptr + at, mask=g_ok[:, None], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + at, mask=g_ok[:, None], other=0.0).to(tl.float32)
        acc += s * d + (z - 128.0 * s) * x_sum[:, None]
    y = tl.sum(acc, axis=0)
    if tl.num_programs(2) == 1:
        _store(y_ptr, b_ptr, y[None, :], t + tl.arange(0, 1), rn, T, N, HAS_BIAS)
    else:
        _sum_splits(y, part_ptr, lock_ptr, y_ptr, b_ptr, t, rn, T, N, HAS_BIAS)


@triton.jit
def _sum_splits(y, part_ptr, lock_ptr, y_ptr, b_ptr, t, rn, T, N, HAS_BIAS: tl.constexpr):
    # K slice program_id(2)'s y [BLOCK_N] fp32 into part [SPLIT, T, N]; the last slice of the
    # row block to arrive (a counter in lock [row blocks, T], back to 0 after) sums them in
    # slice order and stores y with the bias: no launch of its own (module docstring).
    n_ok = rn < N
    split = tl.program_id(2)
    tl.store(part_ptr + (split * T + t).to(tl.int64) * N + rn, y, mask=n_ok)
    tl.debug_barrier()  # every thread's partial stored before the count (released by it)
    lock = lock_ptr + tl.program_id(0) * T + t
    if tl.atomic_add(lock, 1, sem="acq_rel") == tl.num_programs(2) - 1:
        total = tl.zeros_like(y)
        for i in range(0, tl.num_programs(2)):
            at = part_ptr + (i * T + t).to(tl.int64) * N + rn
            total += tl.load(at, mask=n_ok, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + t.to(tl.int64) * N + rn, total.to(y_ptr.dtype.element_ty), mask=n_ok)
        tl.atomic_xchg(lock, 0)


@triton.jit
def _int8_gemv(
    x_ptr,
    q_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    T,
    N,
    K,
    K_SPLIT,
    stride_q,
    stride_s,
    RUNS_PER_GROUP,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(rn < N, rn, 0).to(tl.int64)
    t = tl.program_id(1)
    k_begin = tl.program_id(2) * K_SPLIT
    k_in = 32 * tl.arange(0, BLOCK_K // 32)[:, None] + tl.arange(0, 32)[None, :]
    x_row = x_ptr + t.to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_K // 32, 32), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        w = _int8_tile(q_ptr, s_ptr, rows, stride_q, stride_s, k0, K, RUNS_PER_GROUP, BLOCK_K)
        k = k0 + k_in
        acc += w * tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)[None, :, :]
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    _store(y_ptr, b_ptr, y[None, :], t + tl.arange(0, 1), rn, T, N, HAS_BIAS)


@triton.jit(do_not_specialize=["T"])
def _int4_gemm(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    T,
    N,
    K,
    K_SPLIT,
    stride_q,
    stride_s,
    RUNS_PER_GROUP,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(rn < N, rn, 0).to(tl.int64)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_begin = tl.program_id(2) * K_SPLIT
    h = tl.arange(0, HALF)
    k_h = 32 * (h // 16) + h % 16  # the low input of half-tile position h
    x_rows = x_ptr + rm[:, None].to(tl.int64) * K
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        lo, hi = _int4_tile(
            q_ptr, s_ptr, z_ptr, rows, stride_q, stride_s, k0, K, RUNS_PER_GROUP, BLOCK_K
        )
        k = k0 + k_h
        x_mask = (rm < T)[:, None] & (k < K)[None, :]
        x_lo = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
        x_hi = tl.load(x_rows + (k + 16)[None, :], mask=x_mask, other=0.0)
        acc += _dot(x_lo, tl.reshape(lo, (BLOCK_N, HALF)).to(dtype), UPCAST)
        acc += _dot(x_hi, tl.reshape(hi, (BLOCK_N, HALF)).to(dtype), UPCAST)
    _store(y_ptr, b_ptr, acc, rm, rn, T, N, HAS_BIAS)


@triton.jit(do_not_specialize=["T"])
def _int8_gemm(
    x_ptr,
    q_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    T,
    N,
    K,
    K_SPLIT,
    stride_q,
    stride_s,
    RUNS_PER_GROUP,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(rn < N, rn, 0).to(tl.int64)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_begin = tl.program_id(2) * K_SPLIT
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * K
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        w = _int8_tile(q_ptr, s_ptr, rows, stride_q, stride_s, k0, K, RUNS_PER_GROUP, BLOCK_K)
        k = k0 + kk
        x = tl.load(x_rows + k[None, :], mask=(rm < T)[:, None] & (k < K)[None, :], other=0.0)
        acc += _dot(x, tl.reshape(w, (BLOCK_N, BLOCK_K)).to(dtype), UPCAST)
    _store(y_ptr, b_ptr, acc, rm, rn, T, N, HAS_BIAS)


@triton.jit
def _dot(x, w, UPCAST: tl.constexpr):
    # x [M, BK] @ w [N, BK]^T in fp32. UPCAST: multiply as fp32 (the same rounded inputs), for
    # Triton's CPU interpreter, whose bf16 tl.dot returns garbage (numpy has no bfloat16).
    if UPCAST:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return tl.dot(x, tl.trans(w), input_precision="ieee")


@triton.jit
def _dequant(
    q_ptr,
    s_ptr,
    z_ptr,
    w_ptr,
    N,
    K,
    stride_q,
    stride_s,
    RUNS_PER_GROUP,
    INT4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # w [N, K] (x's dtype) = the weight's rows, as _int4_tile / _int8_tile compute them for the
    # GEMM (z_ptr is read for int4 only).
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(rn < N, rn, 0).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    RUN: tl.constexpr = 16 if INT4 else 32  # inputs a tile holds of each run
    k = k0 + 32 * tl.arange(0, BLOCK_K // 32)[None, :, None] + tl.arange(0, RUN)[None, None, :]
    ok = (rn < N)[:, None, None] & (k < K)
    at = w_ptr + rows[:, None, None] * K + k
    dtype = w_ptr.dtype.element_ty
    if INT4:
        lo, hi = _int4_tile(
            q_ptr, s_ptr, z_ptr, rows, stride_q, stride_s, k0, K, RUNS_PER_GROUP, BLOCK_K
        )
        tl.store(at, lo.to(dtype), mask=ok)
        tl.store(at + 16, hi.to(dtype), mask=ok)
    else:
        w = _int8_tile(q_ptr, s_ptr, rows, stride_q, stride_s, k0, K, RUNS_PER_GROUP, BLOCK_K)
        tl.store(at, w.to(dtype), mask=ok)


def dequantize(
    fmt: str, codes: Tensor, scale: Tensor, zero: Tensor | None, group: int, out: Tensor
) -> Tensor:
    """The weight's rows [n, K] into `out` [>= n, K] (its first n rows; x's dtype), as the
    GEMM's tiles compute them -> out[:n]."""
    n, groups = scale.shape
    k = groups * group
    block_n, block_k = DEQUANT_TILES
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    z = scale if zero is None else zero  # never read for int8
    args = [codes, scale, z, out, n, k, codes.stride(0), scale.stride(0), group // 32]
    _dequant[grid](*args, INT4=fmt == "int4", BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out[:n]


def _dequant_linear(
    x: Tensor,
    fmt: str,
    codes: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    group: int,
    bias: Tensor | None,
) -> Tensor:
    """x [T, K] @ W.T by slabs of W dequantized to x's dtype and torch's GEMM (prefill)."""
    t, k = x.shape
    n = scale.shape[0]
    bias = None if bias is None else bias.to(x.dtype)
    block_n = DEQUANT_TILES[0]
    rows = max(block_n, DEQUANT_SLAB_BYTES // (k * x.element_size()) // block_n * block_n)
    slab = torch.empty(min(rows, n), k, dtype=x.dtype, device=x.device)
    if rows >= n:
        w = dequantize(fmt, codes, scale, zero, group, slab)
        return torch.nn.functional.linear(x, w, bias)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        part = None if zero is None else zero[n0:n1]
        w = dequantize(fmt, codes[n0:n1], scale[n0:n1], part, group, slab)
        y[:, n0:n1] = torch.nn.functional.linear(x, w, None if bias is None else bias[n0:n1])
    return y


def quant_linear(
    x: Tensor,
    fmt: str,
    codes: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    group: int,
    bias: Tensor | None = None,
    tiles: Tiles | None = None,
    swiglu: bool = False,
    rope: RopeWrite | None = None,
) -> Tensor:
    """x [T, K] -> [T, N] in x.dtype for an int8 / int4 weight (dense_quant.QuantWeight's
    tensors, contiguous): the GEMV or fused GEMM by `tiles_for`, or from DEQUANT_MIN_ROWS
    rows the dequantized weight through torch's GEMM; `tiles` forces the fused kernels'
    tiles (benchmarks). Two epilogues for the one-row int4 kernels (word, int8-activation)
    of a single K slice (module docstring), which other tiles run as kernels after the
    projection: `swiglu`, the weight a fused [gate | up] and the result silu(gate) * up
    [T, N / 2]; `rope`, the weight a fused qkv and the result q (RopeWrite)."""
    x = x.contiguous()
    t, k = x.shape
    n, groups = scale.shape
    assert groups * group == k and k % 32 == 0 and group % 32 == 0
    assert codes.is_contiguous() and scale.is_contiguous()
    assert not swiglu or (n % 2 == 0 and bias is None and rope is None)
    head_dim = 0 if rope is None else rope.head_dim(n)
    if tiles is None and t >= DEQUANT_MIN_ROWS:
        return _after(_dequant_linear(x, fmt, codes, scale, zero, group, bias), swiglu, rope)
    cfg = tiles or tiles_for(t, fmt, x.element_size(), x.dtype == torch.bfloat16)
    assert cfg.block_k % 32 == 0 and (cfg.block_m == 1 or cfg.block_m >= 16)
    for special in (cfg.words, cfg.mma, cfg.dp4a):
        assert not special or (fmt == "int4" and cfg.block_m == 1 and x.dtype == torch.bfloat16)
    programs = triton.cdiv(n, cfg.block_n) * triton.cdiv(t, cfg.block_m)
    split = cfg.split or split_k(programs, k, cfg.block_k, sm_count(x.device))
    k_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_split)  # no empty slice
    epilogue = ROPE if rope is not None else SWIGLU if swiglu else PLAIN
    if epilogue != PLAIN and not (
        (cfg.words or cfg.dp4a) and split == 1 and (rope is None or rope.fusable(head_dim))
    ):
        return _after(quant_linear(x, fmt, codes, scale, zero, group, bias, cfg), swiglu, rope)
    if epilogue == SWIGLU:
        y = torch.empty(t, n // 2, dtype=x.dtype, device=x.device)
    elif rope is not None:
        y = torch.empty(t, rope.num_heads, head_dim, dtype=x.dtype, device=x.device)
    elif split == 1:
        y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(split, t, n, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else y  # never read without HAS_BIAS
    args = [x, codes, scale] + ([] if fmt == "int8" else [zero]) + [b, y, t, n, k, k_split]
    args += [codes.stride(0), groups, group // 32]
    launch = dict(
        HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    assert fmt == "int8" or zero is not None
    if cfg.mma:
        cols = max(1, cfg.block_k // group)
        assert gemv_fits(cfg, group)
        grid = (triton.cdiv(n, cfg.block_n), t, split)
        out = y if split == 1 else torch.empty(t, n, dtype=x.dtype, device=x.device)
        locks = counters(x.device, grid[0] * t)
        args = [x, codes.view(torch.int32), scale, zero, bias if bias is not None else out]
        args += [out, y, locks, t, n, k, k_split, k // 32, groups, group // 32]
        launch.update(EVEN_K=k % cfg.block_k == 0, COLS=cols, UPCAST=INTERPRETED)
        _int4_gemv_mma[grid](*args, MMA_MASK, MMA_MAGIC, **launch)
        return out
    elif cfg.words or cfg.dp4a:
        if x.data_ptr() % 4:  # read as int32 pairs
            x = x.clone()
        args[:2] = [x, codes.view(torch.int32)]
        args[-3] = k // 32  # a row's runs (the words' row stride / 4: 16-byte aligned)
        launch.update(EVEN_K=k % cfg.block_k == 0, EPILOGUE=epilogue)
        paired = epilogue != PLAIN
        assert not paired or cfg.block_n % 2 == 0, "paired rows: BLOCK_N even"
        grid = (
            triton.cdiv(n, cfg.block_n) if not paired else triton.cdiv(n // 2, cfg.block_n // 2),
            t,
            split,
        )
        if cfg.dp4a:
            args.append(ROUND_MAGIC)
            kernel, launch["ASM"] = _int4_gemv_dp4a, not INTERPRETED
        else:
            args += [MAGIC, float(2**23)]
            kernel = _int4_gemv_words
        kernel[grid](*args, *_rope_operands(rope, head_dim, y), **launch)
    elif cfg.block_m == 1:
        kernel = _int8_gemv if fmt == "int8" else _int4_gemv
        kernel[(triton.cdiv(n, cfg.block_n), t, split)](*args, **launch)
    else:
        kernel = _int8_gemm if fmt == "int8" else _int4_gemm
        launch.update(UPCAST=INTERPRETED and x.dtype != torch.float32, BLOCK_M=cfg.block_m)
        kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(t, cfg.block_m), split)](*args, **launch)
    return y if split == 1 else y.sum(0).to(x.dtype)


def _rope_operands(rope: RopeWrite | None, head_dim: int, y: Tensor) -> tuple[Tensor | int, ...]:
    """The one-row kernels' RoPE operands (pos, cos, sin, slot, k and v caches, heads, half
    the head); without `rope` never read: y and 1s."""
    if rope is None:
        return (y, y, y, y, y, y, 1, 1, 1)
    return (
        rope.positions,
        rope.cos,
        rope.sin,
        rope.slot_mapping,
        rope.k_cache,
        rope.v_cache,
        rope.num_heads,
        rope.num_kv_heads,
        head_dim // 2,
    )


def _after(y: Tensor, swiglu: bool, rope: RopeWrite | None) -> Tensor:
    """What quant_linear's epilogues compute, as kernels after the projection y [T, N]."""
    if swiglu:
        return triton_activation.silu_and_mul(y)
    if rope is None:
        return y
    return rope.after(y, triton_rope_cache.rope_and_cache)
