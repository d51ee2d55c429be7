"""MXFP4 (OCP Microscaling v1.0): E2M1 elements sharing one E8M0 scale per block of 32 along the last dimension.

Elements: codes 0..7 = +{0, 0.5, 1, 1.5, 2, 3, 4, 6}, 8..15 the same negated (8 = -0). Scale byte b means 2^(b - 127);
0xFF (NaN) is never written. Layout (HF, Quark, vLLM, SGLang, gpt-oss, torchao): byte i of a row is
`code[2i] | code[2i + 1] << 4` (even element in the LOW nibble); `weight` uint8 [..., K/2], `weight_scale` uint8
[..., K/32].

Per block: amax = max |x| (fp32); shared exponent e = floor(log2(amax)) - 2, plus one depending on the scale mode
(`_ROUND_UP_FROM`), clamped to [-127, 127] (all-zero or fp32-subnormal blocks: e = -127, byte 0x00); elements are
`e2m1_code(|x| / 2^e)` (round to nearest, ties to even, saturating at 6) with the sign bit of x (so -0.0 and negatives
that round to zero give code 8). Mode "search" picks, per block, the exponent among floor-1, floor, floor+1 with the
least squared error (ties: floor, then floor+1, then floor-1).

Everything is exact integer or power-of-two arithmetic (never a float8_e8m0fnu cast, which rounds to nearest), so the
compiled and eager kernels agree bit for bit. Non-finite input raises QuantError. Peers: torchao
prototype/mx_formats (to_mx: FLOOR, RCEIL, EVEN), amd/Quark even_round, triton_kernels, microsoft/microxcaling.
"""

from __future__ import annotations

import torch

from quant.errors import QuantError
from quant.numerics import SCALE_MODES, _native  # noqa: F401  (re-exported: mxfp4.SCALE_MODES)
from quant.numerics._compile import Kernel, wants_compiled

BLOCK = 32
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; 8..15 are the negatives

# The scale rule. amax = 1.m * 2^E; the floor exponent E - 2 leaves amax / 2^e in [4, 8). The exponent goes up by one
# when the 23-bit fraction field of amax is at least this value:
_ROUND_UP_FROM = {
    "floor": 1 << 23,  # never: OCP v1.0 "floor(log2(amax)) - emax"; values in (6, 8) x 2^e clip to 6
    "even": 0x600000,  # 1.m >= 1.75: amax / 2^e in [7, 8) would round to 8 at E2M1 precision (Quark, aiter, torchao)
    "rceil": 0x400001,  # 1.m > 1.5: e = ceil(log2(amax / 6)), never clips (NVIDIA, triton_kernels, torchao RCEIL)
}

# Rows of blocks per kernel call: eager intermediates stay in L2; compiled kernels have none, so they take large chunks.
_EAGER_CHUNK_BLOCKS = 1 << 14
_COMPILED_CHUNK_BLOCKS = 1 << 20
_HIGH_HALF = -(1 << 16)  # 0xFFFF0000 as int32


def _scale_bytes(amax_bits: torch.Tensor, round_up_from: torch.Tensor) -> torch.Tensor:
    """E8M0 byte per block from the fp32 bits of amax (int32); 255 marks a non-finite block (rejected later).

    The exponent field is masked rather than relying on a clear sign bit: a NaN from a vectorised max may be 0xFFFFFFFF.
    """
    field = (amax_bits >> 23) & 0xFF
    byte = field - 2 + ((amax_bits & 0x7FFFFF) >= round_up_from).to(torch.int32)
    return torch.where(field == 255, 255, byte.clamp(0, 254))  # clamp = exponent in [-127, 127]


def _pow2_neg_e(byte: torch.Tensor) -> torch.Tensor:
    """2^-e = 2^(127 - byte) as fp32, built from its bits; always a normal number for bytes 0..253."""
    return ((254 - byte.clamp(0, 253)) << 23).view(torch.float32)


def e2m1_code(y: torch.Tensor) -> torch.Tensor:
    """THE ROUNDING RULE. E2M1 code (0..7) of magnitudes y >= 0: round to nearest, ties to even, saturate at 6.

    The code is the number of midpoints between neighbouring E2M1 values (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) that y
    has reached. At an exact midpoint y goes to the even code: '>' where the code below the midpoint is even, '>='
    where the code above it is. Anything above 5 is code 7 (6.0), which is the saturation.
    """
    i32 = torch.int32
    return ((y > 0.25).to(i32) + (y >= 0.75).to(i32) + (y > 1.25).to(i32) + (y >= 1.75).to(i32)
            + (y > 2.5).to(i32) + (y >= 3.5).to(i32) + (y > 5.0).to(i32))


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """The same rule as a value: E2M1 rounding of magnitudes y >= 0 (fp32), used where only errors matter.

    Adding C = 2^23 s (s = grid spacing: 0.5 below 2, 1 below 4, 2 above) leaves y + C with exactly the multiples of s
    representable, so fp32's own round-to-nearest-even puts y on the grid; subtracting C again is exact.
    """
    c = torch.where(y < 2.0, 2.0**22, torch.where(y < 4.0, 2.0**23, 2.0**24))
    return torch.clamp((y + c) - c, max=E2M1_MAX)


def _split_pairs(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 bit patterns (int32) of the even and odd elements of each block.

    `w` is the block data viewed as one integer word per element pair: int32 [N, 16] for bf16 (even element in the
    low half, little-endian) or int64 [N, 16] for fp32.
    """
    if w.dtype == torch.int64:
        return w.to(torch.int32), (w >> 32).to(torch.int32)
    return w << 16, w & _HIGH_HALF


def _block_amax(alo: torch.Tensor, ahi: torch.Tensor) -> torch.Tensor:
    """fp32 bits of max |x| per block from the |x| bits of both halves; a NaN anywhere makes it NaN (field 255)."""
    m = torch.maximum(alo, ahi).view(torch.float32)  # non-negative floats order like their bits
    return m.amax(dim=-1, keepdim=True).view(torch.int32)


def _pack(code_lo: torch.Tensor, code_hi: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Add the sign bits (bit 31 of the fp32 patterns) and pack: even element in the low nibble."""
    code_lo = code_lo | ((lo >> 28) & 8)
    code_hi = code_hi | ((hi >> 28) & 8)
    return (code_lo | (code_hi << 4)).to(torch.uint8)


def _scales(w: torch.Tensor, round_up_from: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale bytes [N, 1] (uint8) of the floor/even/rceil rules, and whether any block is non-finite."""
    lo, hi = _split_pairs(w)
    byte = _scale_bytes(_block_amax(lo & 0x7FFFFFFF, hi & 0x7FFFFFFF), round_up_from)
    return byte.to(torch.uint8), (byte == 255).any()


def _codes(w: torch.Tensor, byte: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes [N, 16] of the blocks for the given scale bytes [N, 1]: the reference element kernel."""
    lo, hi = _split_pairs(w)
    inv = _pow2_neg_e(byte.to(torch.int32))  # x * 2^-e is exact: scaling by a power of two
    code_lo = e2m1_code((lo & 0x7FFFFFFF).view(torch.float32) * inv)
    code_hi = e2m1_code((hi & 0x7FFFFFFF).view(torch.float32) * inv)
    return _pack(code_lo, code_hi, lo, hi)


# Search errors: per element (x - q)^2 in fp32, in units of 2^-14 of the floor scale squared, truncated to whole
# units. Each term is then an integer below 2^19 (|x - q| <= 5 floor-scale units) and a block's sum below 2^24, exact
# in fp32 in any summation order: eager and compiled kernels (and the tests' numpy reference) agree exactly, ties
# included. The resolution (6e-5 of a floor-scale unit squared, while amax is 4..8 units) only decides near-ties.
_SEARCH_UNIT_LOG2 = 14


def _search_scales(w: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """Per block, the scale byte among floor, floor+1, floor-1 (bytes [N, 1]) with the least squared error.

    A candidate replaces the current best only when strictly better, in that order: ties prefer floor, then the
    larger scale (less clipping). Returns bytes [N, 1] uint8 (255 where floor is 255: non-finite block).
    """
    lo, hi = _split_pairs(w)
    alo, ahi = (lo & 0x7FFFFFFF).view(torch.float32), (hi & 0x7FFFFFFF).view(torch.float32)
    floor = floor.to(torch.int32)

    def error(byte: torch.Tensor) -> torch.Tensor:
        inv = _pow2_neg_e(byte)
        # (d * 2^(e - e_floor))^2 in units of 2^-14 = d^2 * 2^(14 + 2 (e - e_floor)), d in units of this candidate
        unit = ((2 * (byte - floor) + _SEARCH_UNIT_LOG2 + 127) << 23).view(torch.float32)
        y_lo, y_hi = alo * inv, ahi * inv
        d_lo, d_hi = y_lo - e2m1_round(y_lo), y_hi - e2m1_round(y_hi)
        return (torch.floor(d_lo * d_lo * unit) + torch.floor(d_hi * d_hi * unit)).sum(dim=-1, keepdim=True)

    best, best_err = floor, error(floor)
    for byte in ((floor + 1).clamp(0, 253), (floor - 1).clamp(0, 253)):
        err = error(byte)
        better = err < best_err
        best, best_err = torch.where(better, byte, best), torch.where(better, err, best_err)
    return torch.where(floor == 255, 255, best).to(torch.uint8)


# bf16 bit patterns of the E2M1 midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5; a '>' test of e2m1_code becomes '>='
# against the next bit pattern up.
_MIDPOINTS_BF16 = (0x3E80 + 1, 0x3F40, 0x3FA0 + 1, 0x3FE0, 0x4020 + 1, 0x4060, 0x40A0 + 1)
# Below this byte, exponent subtraction on bf16 bits is not exact for bf16-subnormal elements (see _bf16_codes).
_BF16_MIN_EXACT_BYTE = 3


def _bf16_scales(w: torch.Tensor, round_up_from: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_scales` for bf16 blocks (same bytes), plus the exponent shift `_bf16_codes` applies; the flag also marks
    blocks that need the reference element kernel (byte < 3)."""
    amag = w & 0x7FFF7FFF
    # max(|even|, |odd|) in the high half of each word; low-half bits only break ties between equal maxima.
    amax = torch.maximum(amag, amag << 16).view(torch.float32).amax(dim=-1, keepdim=True)
    byte = _scale_bytes(amax.view(torch.int32) & _HIGH_HALF, round_up_from)
    shift = (0x3F80 - byte.clamp(_BF16_MIN_EXACT_BYTE, 254) * 128) * 0x10001  # (127 - byte) << 7 in both lanes
    return byte.to(torch.uint8), shift, ((byte < _BF16_MIN_EXACT_BYTE) | (byte == 255)).any()


def _bf16_codes(w: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Packed codes of bf16 blocks, bit-identical to `_codes` for blocks with byte >= 3 or all zeros.

    Each int32 word holds two bf16 elements and is processed as two 16-bit lanes at once. y = |x| / 2^e is formed by
    subtracting e from the bf16 exponent field, which is exact for normal results (results below 2^-126 land below
    every midpoint, as they should); the code is then `e2m1_code`'s midpoint count, each test read off bit 15 of
    (0x8000 + y - midpoint) in each lane. That bias keeps every lane within 16 bits, so lanes never borrow from each
    other; the word arithmetic relies on two's-complement wrap-around. For blocks with byte < 3 (amax < 2^-122) the
    shift is clamped, which is wrong for their bf16-subnormal elements: the caller re-encodes those blocks.
    """
    biased_y = (w | -0x7FFF8000) + shift  # 0x8000 + bf16 bits of y per lane: setting bit 15 replaces the sign
    codes = (w >> 12) & 0x80008  # sign bits (15, 31) -> code bit 3 of each lane
    for m in _MIDPOINTS_BF16:
        codes = codes + (((biased_y - m * 0x10001) >> 15) & 0x10001)
    # bits 0-3: even element's code, 16-19: odd element's; the uint8 conversion keeps the low byte
    return (codes | (codes >> 12)).to(torch.uint8)


def _example_words(dtype: torch.dtype) -> torch.Tensor:
    """Sample blocks for compiling kernels ahead of time: [N, 16] pair words (int32 for bf16, int64 for fp32)."""
    x = torch.randn(4096 * BLOCK, generator=torch.Generator().manual_seed(0))
    return _as_pair_words(x.to(torch.bfloat16) if dtype == torch.int32 else x)


def _example_bytes() -> torch.Tensor:
    return torch.full((4096, 1), 120, dtype=torch.uint8)


def _round_up_example() -> torch.Tensor:
    return torch.tensor(0x600000, dtype=torch.int32)

BF16_SCALES = Kernel(_bf16_scales, examples=lambda: [(_example_words(torch.int32), _round_up_example())])
BF16_CODES = Kernel(_bf16_codes, examples=lambda: [(_example_words(torch.int32),
                                                    torch.full((4096, 1), 0x0A000A00, dtype=torch.int32))])


def _encode_bf16(w: torch.Tensor, round_up_from: torch.Tensor, *, compiled: bool):
    """floor/even/rceil for bf16, like `_encode` (the caller re-encodes blocks with byte < 3)."""
    byte, shift, flag = BF16_SCALES(w, round_up_from, compiled=compiled)
    return BF16_CODES(w, shift, compiled=compiled), byte, flag


_WORD_DTYPES = (torch.int32, torch.int64)  # pair words of bf16 input (search mode) and of fp16/fp32 input
SCALES = Kernel(_scales, examples=lambda: [(_example_words(dt), _round_up_example()) for dt in _WORD_DTYPES])
SEARCH_SCALES = Kernel(_search_scales, examples=lambda: [(_example_words(dt), _example_bytes()) for dt in _WORD_DTYPES])
CODES = Kernel(_codes, examples=lambda: [(_example_words(dt), _example_bytes()) for dt in _WORD_DTYPES])


def _encode(w: torch.Tensor, round_up_from: torch.Tensor, *, compiled: bool):
    """floor/even/rceil for any input dtype: (packed [N, 16], bytes [N, 1], any non-finite block)."""
    byte, flag = SCALES(w, round_up_from, compiled=compiled)
    return CODES(w, byte, compiled=compiled), byte, flag


def _encode_search(w: torch.Tensor, *, compiled: bool):
    """search mode for any input dtype: (packed [N, 16], bytes [N, 1], any non-finite block).

    Three kernels (floor scales, search, codes): fused, inductor's CPU code for them is several times slower."""
    round_down = torch.tensor(_ROUND_UP_FROM["floor"], dtype=torch.int32, device=w.device)
    floor, flag = SCALES(w, round_down, compiled=compiled)
    byte = SEARCH_SCALES(w, floor, compiled=compiled)
    return CODES(w, byte, compiled=compiled), byte, flag


def _as_pair_words(x: torch.Tensor) -> torch.Tensor:
    """The blocks of a contiguous float tensor as [N, 16] integer words, one per element pair (see _split_pairs)."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int32).view(-1, BLOCK // 2)
    return x.to(torch.float32).view(torch.int64).view(-1, BLOCK // 2)


def _run(kernel, w: torch.Tensor, *args, compiled: bool | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Apply an encoder to the blocks `w` [N, 16] in chunks; returns (packed [N, 16], bytes [N], its flag)."""
    compiled = wants_compiled(w.numel() * 2, compiled)
    step = _COMPILED_CHUNK_BLOCKS if compiled else _EAGER_CHUNK_BLOCKS
    n = w.shape[0]
    if n <= step:
        packed, byte, flag = kernel(w, *args, compiled=compiled)
        return packed, byte.view(-1), bool(flag)
    packed = torch.empty((n, BLOCK // 2), dtype=torch.uint8, device=w.device)
    byte = torch.empty(n, dtype=torch.uint8, device=w.device)
    flags = []
    for i in range(0, n, step):
        p, b, f = kernel(w[i:i + step], *args, compiled=compiled)
        packed[i:i + step], byte[i:i + step] = p, b.view(-1)
        flags.append(f)
    return packed, byte, bool(torch.stack(flags).any())


def _uses_native(w: torch.Tensor, compiled: bool | None) -> bool:
    """Whether compiled kernels are wanted (forced, or a built one may be used) and the native library is built."""
    return wants_compiled(w.numel() * 2, compiled) is not False and _native.library() is not None


def _check_input(x: torch.Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise QuantError(f"MXFP4 quantization needs a bf16/fp16/fp32 tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise QuantError(f"MXFP4 needs the last dimension to be a multiple of {BLOCK}, got shape {tuple(x.shape)}")


def quantize_mxfp4(x: torch.Tensor, mode: str = "even", *, compiled: bool | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` [..., K] (bf16/fp16/fp32, K % 32 == 0) along its last dimension.

    Returns (packed uint8 [..., K/2], scales uint8 E8M0 [..., K/32]) on x.device. `compiled` forces (True) or forbids
    (False) the torch.compile'd kernels; None decides by size and QUANT_NO_COMPILE.
    """
    if mode not in SCALE_MODES:
        raise QuantError(f"unknown MXFP4 scale mode {mode!r}; choose one of {', '.join(SCALE_MODES)}")
    _check_input(x)
    x = x.contiguous()
    lead, k = x.shape[:-1], x.shape[-1]
    if x.numel() == 0:
        return (torch.empty(*lead, k // 2, dtype=torch.uint8, device=x.device),
                torch.empty(*lead, k // BLOCK, dtype=torch.uint8, device=x.device))
    w = _as_pair_words(x)
    if mode == "search":
        packed, byte, special = _run(_encode_search, w, compiled=compiled)
    else:
        round_up_from = torch.tensor(_ROUND_UP_FROM[mode], dtype=torch.int32, device=x.device)
        fast_bf16 = x.dtype == torch.bfloat16
        if fast_bf16 and x.device.type == "cpu" and _uses_native(w, compiled):
            # the same integer kernels, vectorised by hand for AVX2 / AVX-512 (see _native)
            packed, byte, special = _native.mxfp4_bf16(x, _ROUND_UP_FROM[mode])
        else:
            packed, byte, special = _run(_encode_bf16 if fast_bf16 else _encode, w, round_up_from,
                                         compiled=compiled)
        if special and fast_bf16:
            redo = (byte < _BF16_MIN_EXACT_BYTE).nonzero().view(-1)
            if redo.numel():
                packed[redo] = _codes(w[redo], byte[redo].view(-1, 1))
    if special and bool((byte == 255).any()):
        bad = int((~torch.isfinite(x)).sum())
        raise QuantError(f"cannot quantize to MXFP4: {bad} non-finite value(s) (NaN/Inf) in tensor of shape "
                         f"{tuple(x.shape)}")
    return packed.view(*lead, k // 2), byte.view(*lead, k // BLOCK)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(b - 127); byte 0 is 2^-127 (an fp32 subnormal), 0xFF is NaN."""
    b = scales.to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, torch.where(b == 255, 0x7FC00000, b << 23))
    return bits.view(torch.float32)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of E2M1 codes 0..15, built from bits: sign, 2 exponent bits (bias 1) and 1 mantissa bit."""
    c = codes.to(torch.int32)
    exponent, mantissa = (c >> 1) & 3, c & 1
    magnitude = torch.where(exponent == 0, mantissa * 0x3F000000, ((exponent + 126) << 23) | (mantissa << 22))
    return (magnitude | ((c & 8) << 28)).view(torch.float32)


def _dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks packed [N, 16] with bytes [N, 1] -> `dtype` [N, 32]; exact in fp32 before the final cast.

    Each byte is looked up in a table of its two values (even element: low nibble): one gather instead of
    decoding each nibble's bits, which eagerly is a dozen passes over the data."""
    byte = torch.arange(256, dtype=torch.int32, device=packed.device)
    pair_values = torch.stack((e2m1_values(byte & 0xF), e2m1_values(byte >> 4)), dim=-1)
    return (pair_values[packed.long()].view(-1, BLOCK) * scale_values(scales)).to(dtype)


DEQUANTIZE = Kernel(_dequantize)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                     compiled: bool | None = None) -> torch.Tensor:
    """Inverse of `quantize_mxfp4`: (uint8 [..., K/2], uint8 [..., K/32]) -> `dtype` [..., K], computed in fp32.

    Values are exact in fp32 except beyond its range (scale bytes >= 0xFD with large codes), which give inf.
    """
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantError(f"MXFP4 weight and scale must be uint8, got {packed.dtype} and {scales.dtype}")
    if (packed.dim() == 0 or packed.shape[:-1] != scales.shape[:-1]
            or packed.shape[-1] != scales.shape[-1] * (BLOCK // 2)):
        raise QuantError(f"MXFP4 weight shape {tuple(packed.shape)} does not match scale shape "
                         f"{tuple(scales.shape)} (expected weight [..., 16 * n] for scale [..., n])")
    out_shape = (*packed.shape[:-1], packed.shape[-1] * 2)
    blocks, byte = packed.contiguous().view(-1, BLOCK // 2), scales.contiguous().view(-1, 1)
    compiled = wants_compiled(blocks.numel() * 2, compiled)
    step = _COMPILED_CHUNK_BLOCKS if compiled else _EAGER_CHUNK_BLOCKS
    if blocks.shape[0] <= step:
        return DEQUANTIZE(blocks, byte, dtype, compiled=compiled).view(out_shape)
    out = torch.empty((blocks.shape[0], BLOCK), dtype=dtype, device=packed.device)
    for i in range(0, blocks.shape[0], step):
        out[i:i + step] = DEQUANTIZE(blocks[i:i + step], byte[i:i + step], dtype, compiled=compiled)
    return out.view(out_shape)


def _error_sums(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[sum of squared quantization errors, sum of squares of x] over x [R, K] and its MXFP4 encoding, summed in
    fp64 (each error is one IEEE fp32 operation, the same on every CPU; fp32 sums rounded differently per vector ISA).
    Codes are decoded arithmetically, not through `_dequantize`'s table: compiled,
    a table lookup is a gather the vectoriser cannot handle (six times slower here)."""
    rows = x.shape[0]
    xf = x.to(torch.float32).view(rows, -1, BLOCK // 2, 2)
    q = torch.stack((e2m1_values(packed & 0xF), e2m1_values(packed >> 4)), dim=-1).view(rows, -1, BLOCK // 2, 2)
    d = (xf - q * scale_values(scales).view(rows, -1, 1, 1)).to(torch.float64)
    xd = xf.to(torch.float64)
    return torch.stack(((d * d).sum(), (xd * xd).sum()))


def _example_error_args(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    x = torch.randn(48, 4 * BLOCK).to(dtype)
    packed, scales = quantize_mxfp4(x, compiled=False)
    return x, packed, scales


ERROR_SUMS = Kernel(_error_sums, dynamic_dims=(0, 1),
                    examples=lambda: [_example_error_args(dt) for dt in (torch.bfloat16, torch.float32)])


def quantization_error(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, *,
                       compiled: bool | None = None) -> tuple[float, float]:
    """(sum of squared errors, sum of squares) of x [R, K] against its encoding (packed [R, K/2], scales [R, K/32]):
    the numerator and denominator of the relative MSE, in one pass instead of dequantize-then-compare."""
    sums = ERROR_SUMS(x.contiguous(), packed.contiguous(), scales.contiguous(),
                      compiled=wants_compiled(x.numel(), compiled))
    return float(sums[0]), float(sums[1])


def round_with_scales(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., n] (fp32) on the MXFP4 grid of the given scale bytes [..., 1] (or broadcastable): the value
    `quantize_mxfp4` would store for each element under that scale, by the same rule (`e2m1_code`: nearest, ties to
    even, saturating at 6, the sign of x kept). For callers that choose scales first and round afterwards (GPTQ)."""
    inv = _pow2_neg_e(scales.to(torch.int32))
    y = x.abs() * inv
    return torch.copysign(e2m1_round(y) * scale_values(scales), x)


def encode_with_scales(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes (uint8 [..., K/2]) of x [..., K] under the given scale bytes [..., K/32] (uint8): the
    element kernel of `quantize_mxfp4` with the scales supplied instead of derived from x."""
    _check_input(x)
    lead, k = x.shape[:-1], x.shape[-1]
    words = _as_pair_words(x.to(torch.float32).contiguous())
    packed = _codes(words, scales.reshape(-1, 1))
    return packed.view(*lead, k // 2)
