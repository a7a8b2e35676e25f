"""KV codecs: exact byte round trips, error bounds against float64 references, fixed record
sizes, determinism across batch/device/dtype paths, and the error seen by attention."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from hybridgen.kvtiers.codec import CODECS, CorruptRecord, Lz4Codec, get_codec
from hybridgen.kvtiers.quant import pack_u4, unpack_u4

S, H, D = 16, 4, 128  # block_size, num_kv_heads, head_dim
EXACT, LOSSY = ("lossless", "lz4"), ("int8", "int4")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kv_blocks(n: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """k, v: [n, S, H, D]; 4 channels of each K head are 10-20x larger, as in real LLM keys."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, S, H, D, generator=g)
    v = torch.randn(n, S, H, D, generator=g)
    for h in range(H):
        channels = torch.randperm(D, generator=g)[:4]
        k[:, :, h, channels] *= 10 + 10 * torch.rand(4, generator=g)
    return k.to(dtype), v.to(dtype)


def rel_err(approx: Tensor, exact: Tensor) -> float:
    a, e = approx.double(), exact.double()
    return ((a - e).norm() / e.norm()).item()


def as_bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.uint8)


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q: [Hq, T, D], k, v: [L, H, D] with Hq = G * H (GQA) -> [Hq, T, D], float64."""
    kh = k.double().transpose(0, 1).repeat_interleave(q.shape[0] // k.shape[1], 0)  # [Hq, L, D]
    vh = v.double().transpose(0, 1).repeat_interleave(q.shape[0] // v.shape[1], 0)
    p = torch.softmax(q.double() @ kh.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
    return p @ vh


# --- exact codecs ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", EXACT)
def test_exact_codecs_round_trip_every_bit(name: str, dtype: torch.dtype) -> None:
    codec = get_codec(name, S, H, D, dtype)
    k, v = kv_blocks(3, seed=1, dtype=dtype)
    # Random bit patterns cover NaN payloads, infinities, -0.0 and subnormals.
    g = torch.Generator().manual_seed(2)
    noise = torch.randint(0, 256, (2, *as_bytes(k[0]).shape), dtype=torch.uint8, generator=g)
    k[0], v[0] = noise[0].view(dtype), noise[1].view(dtype)
    records = codec.encode_blocks(k, v)
    assert records.shape == (3, codec.record_bytes) and records.dtype == torch.uint8
    k2, v2 = codec.decode_blocks(records, dtype)
    assert torch.equal(as_bytes(k2), as_bytes(k)) and torch.equal(as_bytes(v2), as_bytes(v))


def test_lz4_compresses_when_it_can_and_stores_raw_when_it_cannot() -> None:
    codec = get_codec("lz4", S, H, D, torch.bfloat16)
    assert isinstance(codec, Lz4Codec)
    k, v = kv_blocks(2, seed=3, dtype=torch.bfloat16)
    k[1] = 0.5  # a constant block: lz4 shrinks it a lot
    v[1] = torch.arange(D, dtype=torch.bfloat16)
    records = codec.encode_blocks(k, v)
    raw = codec.inner.record_bytes
    stored = codec.stored_bytes(records)
    print(f"\nlz4 stored bytes {stored} of {raw} raw, slot {codec.record_bytes}")
    assert stored[1] < raw // 20
    assert codec.record_bytes == raw + 16  # worst case: raw payload plus the header
    k2, v2 = codec.decode_blocks(records)
    assert torch.equal(as_bytes(k2), as_bytes(k)) and torch.equal(as_bytes(v2), as_bytes(v))
    torn = records.clone()
    torn[0, :4] = 255
    with pytest.raises(CorruptRecord, match="stores"):
        codec.decode_blocks(torn)


def test_lz4_over_a_lossy_codec_decodes_like_the_codec_itself() -> None:
    warm = get_codec("int8", S, H, D, torch.bfloat16)
    cold = Lz4Codec(warm)  # how the Cold tier stores a warm block
    k, v = kv_blocks(2, seed=4, dtype=torch.bfloat16)
    assert cold.record_bytes == warm.record_bytes + 16
    exact = warm.decode_blocks(warm.encode_blocks(k, v))
    for a, b in zip(cold.decode_blocks(cold.encode_blocks(k, v)), exact, strict=True):
        assert torch.equal(a, b)


# --- lossy codecs: error against float64 references -----------------------------------------


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_lossy_relative_error_with_outlier_channels(dtype: torch.dtype) -> None:
    k, v = kv_blocks(8, seed=5, dtype=dtype)
    # K bounds cover outlier channels inside int8's per-token groups (measured ~0.011).
    bounds = {"int8": (0.02, 0.01), "int4": (0.12, 0.12)}
    for name in LOSSY:
        codec = get_codec(name, S, H, D, dtype)
        k2, v2 = codec.decode_blocks(codec.encode_blocks(k, v), torch.float32)
        ek, ev = rel_err(k2, k), rel_err(v2, v)
        print(f"\n{name} {dtype}: ratio {codec.ratio_vs_fp16:.4f}, rel err K {ek:.4f} V {ev:.4f}")
        assert ek < bounds[name][0] and ev < bounds[name][1]


def per_token_int4(x: Tensor, g: int) -> Tensor:
    """The float64 reference of asymmetric int4 grouped along head_dim, fake-quantized."""
    xg = x.double().unflatten(-1, (-1, g))
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    step = ((hi - lo) / 15).clamp_min(1e-30)
    return (torch.round((xg - lo) / step).clamp(0, 15) * step + lo).flatten(-2)


def test_int4_per_channel_keys_beat_per_token_on_outliers() -> None:
    """Per-token groups take their scale from the outlier channel, which wipes out the many
    ordinary channels in the same group; per-channel groups keep each channel's own range."""
    k, v = kv_blocks(8, seed=6)
    codec = get_codec("int4", S, H, D, torch.float32)
    k2, _ = codec.decode_blocks(codec.encode_blocks(k, v))
    kt = per_token_int4(k, 32)
    ordinary = (k.abs().amax((0, 1), keepdim=True) < 6).expand_as(k)  # not an outlier channel
    channel, token = rel_err(k2[ordinary], k[ordinary]), rel_err(kt[ordinary], k[ordinary])
    q = torch.randn(2 * H, 4, D, generator=torch.Generator().manual_seed(7))
    exact = attention(q, k.flatten(0, 1), v.flatten(0, 1))
    att_channel = rel_err(attention(q, k2.flatten(0, 1), v.flatten(0, 1)), exact)
    att_token = rel_err(attention(q, kt.flatten(0, 1), v.flatten(0, 1)), exact)
    print(
        f"\nint4 K rel err per-channel / per-token: all {rel_err(k2, k):.4f} / "
        f"{rel_err(kt, k):.4f}, ordinary channels {channel:.4f} / {token:.4f}, "
        f"attention (K only) {att_channel:.4f} / {att_token:.4f}"
    )
    assert channel < 0.3 * token  # measured ~0.2
    assert att_channel < 0.6 * att_token  # measured ~0.3 over seeds


def quant_steps(name: str, x: Tensor, which: str, g: int) -> tuple[Tensor, Tensor]:
    """float64 (step, base magnitude) per element of x [N, S, H, D], from the group's range."""
    x = x.double()
    if name == "int8":
        amax = x.unflatten(-1, (-1, g)).abs().amax(-1, keepdim=True)
        return (amax / 127).expand(*amax.shape[:-1], g).flatten(-2), torch.zeros_like(x)
    if which == "k":  # one group per channel over the block's tokens
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        return ((hi - lo) / 15).expand_as(x), lo.abs().expand_as(x)
    xg = x.unflatten(-1, (-1, g))
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    shape = (*lo.shape[:-1], g)
    return ((hi - lo) / 15).expand(shape).flatten(-2), lo.abs().expand(shape).flatten(-2)


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(LOSSY),
    block_size=st.sampled_from((8, 16)),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from((16, 32, 64)),
    group=st.sampled_from((32, 64)),
    scale_dtype=st.sampled_from((torch.float16, torch.float32)),
    magnitude=st.floats(1e-5, 1e2),  # fp16 zeros need |x| < 65504
    seed=st.integers(0, 2**16),
)
def test_every_element_within_half_a_step(
    name: str,
    block_size: int,
    heads: int,
    head_dim: int,
    group: int,
    scale_dtype: torch.dtype,
    magnitude: float,
    seed: int,
) -> None:
    codec = get_codec(
        name, block_size, heads, head_dim, torch.float32, group_size=group, scale_dtype=scale_dtype
    )
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, block_size, heads, head_dim, generator=g) * magnitude
    k[..., 0] *= 15
    v = torch.randn(2, block_size, heads, head_dim, generator=g) * magnitude + magnitude
    k2, v2 = codec.decode_blocks(codec.encode_blocks(k, v))
    for which, x, x2 in (("k", k, k2), ("v", v, v2)):
        step, base = quant_steps(name, x, which, min(group, head_dim))
        # Half a step; the scale is rounded up and the zero down to fp16 (< 1 ulp: 2**-10
        # relative, or 2**-24 where subnormal), so nothing is ever clamped.
        bound = 0.5 * step * (1 + 2**-9) + base * 2**-14 + 2**-24 + 1e-6 * magnitude
        assert bool(((x2.double() - x.double()).abs() <= bound).all()), (name, which)


# --- fixed size, determinism, batched and device paths --------------------------------------


@pytest.mark.parametrize("name", EXACT + LOSSY)
def test_record_size_is_fixed_and_encoding_is_deterministic(name: str) -> None:
    codec = get_codec(name, S, H, D, torch.bfloat16)
    k, v = kv_blocks(1, seed=7, dtype=torch.bfloat16)
    inputs = [(k[0], v[0]), (torch.zeros_like(k[0]), torch.zeros_like(v[0])), (k[0] * 1e4, v[0])]
    for a, b in inputs:
        record = codec.encode(a, b)
        assert record.shape == (codec.record_bytes,) and record.dtype == torch.uint8
        assert torch.equal(record, codec.encode(a.clone(), b.clone()))
    assert codec.record_bytes % 16 == 0
    assert math.isclose(codec.ratio_vs_fp16, 2 * 2 * S * H * D / codec.record_bytes)


@pytest.mark.parametrize("name", EXACT + LOSSY)
def test_blocks_calls_equal_per_block_calls(name: str) -> None:
    codec = get_codec(name, S, H, D, torch.float32)
    k, v = kv_blocks(5, seed=8)
    records = codec.encode_blocks(k, v)
    kd, vd = codec.decode_blocks(records)
    for i in range(5):
        assert torch.equal(records[i], codec.encode(k[i], v[i]))
        ki, vi = codec.decode(records[i])
        assert torch.equal(ki, kd[i]) and torch.equal(vi, vd[i])


@pytest.mark.parametrize("name", LOSSY)
def test_same_bytes_on_every_path(name: str) -> None:
    """GPU and CPU daemons must agree byte for byte; without CUDA, the paths this machine has:
    a block's record does not depend on its batch neighbours, and bf16 input encodes exactly
    like the same values given in fp32 (the math runs in fp32 after an exact upcast)."""
    k, v = kv_blocks(4, seed=9, dtype=torch.bfloat16)
    codec = get_codec(name, S, H, D, torch.bfloat16)
    records = codec.encode_blocks(k, v)
    if torch.cuda.is_available():
        on_gpu = codec.encode_blocks(k.cuda(), v.cuda())
        assert torch.equal(on_gpu.cpu(), records)
        for a, b in zip(codec.decode_blocks(on_gpu), codec.decode_blocks(records), strict=True):
            assert torch.equal(a.cpu(), b)
    others = kv_blocks(4, seed=10, dtype=torch.bfloat16)
    mixed = codec.encode_blocks(
        torch.cat((others[0][:2], k[2:3])), torch.cat((others[1][:2], v[2:3]))
    )
    assert torch.equal(mixed[2], records[2]) and torch.equal(mixed[2], codec.encode(k[2], v[2]))
    fp32 = get_codec(name, S, H, D, torch.float32)
    assert torch.equal(fp32.encode_blocks(k.float(), v.float()), records)


def test_nibble_packing_round_trips_all_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8).repeat_interleave(16).reshape(8, 32)
    codes = torch.cat((codes, codes.flip(-1)), -1)  # every (low, high) pair
    assert torch.equal(unpack_u4(pack_u4(codes)), codes)
    assert pack_u4(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21


# --- attention over decoded blocks ----------------------------------------------------------


@pytest.mark.parametrize(("name", "bound"), (("int8", 0.06), ("int4", 0.2)))
def test_attention_output_error(name: str, bound: float) -> None:
    k, v = kv_blocks(8, seed=11)  # 128 tokens
    q = torch.randn(2 * H, 4, D, generator=torch.Generator().manual_seed(12))
    codec = get_codec(name, S, H, D, torch.float32)
    k2, v2 = codec.decode_blocks(codec.encode_blocks(k, v))
    exact = attention(q, k.flatten(0, 1), v.flatten(0, 1))
    err = rel_err(attention(q, k2.flatten(0, 1), v2.flatten(0, 1)), exact)
    # Random V rows average out, so the exact output is small and its relative error large:
    # measured 0.025-0.036 (int8) and 0.10-0.16 (int4) over seeds.
    print(f"\n{name} attention output rel err {err:.4f}")
    assert err < bound


# --- errors ---------------------------------------------------------------------------------


def test_unknown_name_and_bad_options_say_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"kv_cache\.warm_codec='zstd'") as info:
        get_codec("zstd", S, H, D, torch.float32)
    assert all(name in str(info.value) for name in CODECS)
    with pytest.raises(ValueError, match=r"kv_cache\.hot_codec='fp8'"):
        get_codec("fp8", S, H, D, torch.float32, key="kv_cache.hot_codec")
    with pytest.raises(ValueError, match="head_dim=96"):
        get_codec("int4", S, H, 96, torch.float32, group_size=64)
    with pytest.raises(ValueError, match="scale_dtype"):
        get_codec("int8", S, H, D, torch.float32, scale_dtype=torch.bfloat16)
    codec = get_codec("int8", S, H, D, torch.float32)
    with pytest.raises(ValueError, match=r"expected torch.float32 \[N, 16, 4, 128\]"):
        codec.encode_blocks(torch.zeros(1, S, H, 64), torch.zeros(1, S, H, 64))
    with pytest.raises(ValueError, match=rf"expected uint8 \[N, {codec.record_bytes}\]"):
        codec.decode_blocks(torch.zeros(1, 7, dtype=torch.uint8))
