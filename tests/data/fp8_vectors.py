# Reference vectors kept in the repository so the tests depend on nothing outside it. Data only.
"""Bit-exact block-FP8 test vectors (DeepSeek-V3 / GLM-5 style: float8_e4m3fn, 128x128 tiles, weight_scale_inv).

Data only; no imports. ``FP8_BLOCK_VECTORS`` is a list of dicts, one per 128x128 float32 tile:

    name            str   vector id
    note            str   what the vector exercises
    tile_shape      (128, 128); every element not listed in ``cells`` is +0.0
    cells           list of (row, col, value): the listed inputs; build the tile in float32
                    (torch.tensor(..., dtype=torch.float32) rounding, e.g. 0.3 -> 0.30000001192092896)
    scale_inv       float32 weight_scale_inv of the tile = amax / 448 (computed in fp32)
    scale_inv_bits  IEEE-754 bits of scale_inv
    codes           dict formula -> list of uint8 codes (the float8_e4m3fn bit patterns), one per entry of
                    ``cells``, in the same order:
                      "div"        q = e4m3fn(clamp(x / scale_inv, -448, 448))          (reference; x / s)
                      "mul_recip"  q = e4m3fn(clamp(x * (1 / scale_inv), -448, 448))    (DeepGEMM per_block_cast_to_fp8)
                      "mul_448"    q = e4m3fn(clamp(x * (448 / amax), -448, 448))       (vLLM / SGLang test helpers)
    scale_inv_ue8m0 (FP8_A only) scale_inv with scale_fmt "ue8m0": 2 ** ceil(log2(amax / 448)); codes identical
    dequant         (FP8_A only) q.float() * scale_inv for each cell

Conventions
-----------
* Checkpoint layout: ``<name>.weight`` float8_e4m3fn [out, in]; ``<name>.weight_scale_inv`` float32
  [ceil(out/128), ceil(in/128)]; dequant w[i, j] = q[i, j] * scale_inv[i // 128, j // 128].
* float -> e4m3fn conversion is round-to-nearest-even with saturation to +-448 (clamp explicitly before
  casting; 0x7E = 448, 0x7F = NaN, no Inf). Min subnormal 2**-9 (code 0x01); sign bit 0x80 (-0.0 -> 0x80).
* Reference quantizer (torch):
      amax = tile.abs().amax(); s = amax / 448.0
      q = torch.clamp(tile / s, -448.0, 448.0).to(torch.float8_e4m3fn)
* A zero tile gives s = 0 and x / s = NaN unless amax is guarded (e.g. DeepGEMM clamps amax to 1e-4,
  scale_inv 2.2321428616578487e-07, bits 0x346FACAD); the codes are all 0 either way.
* Checked with torch 2.13.0 (CPU), which saturates e4m3fn casts.
"""

FP8_BLOCK_VECTORS = [
    dict(
        name='FP8_A_amax_1p75',
        note=('amax = 1.75 -> scale_inv = 2^-8 exactly; all three formulas and ue8m0 agree. '
              '0.3*256 = 76.8 -> 80; 76/256 is a tie 72/80 -> 80 (even mantissa); 2^-17 -> min subnormal; '
              '2^-18*256 = 2^-10 is a tie -> 0; 3*2^-19 -> 2^-9; 1.6*256 = 409.6 -> 416'),
        tile_shape=(128, 128),
        cells=[(0, 0, 1.75), (0, 1, -1.75), (0, 2, 0.3), (0, 3, 76 / 256), (0, 4, 72 / 256), (0, 5, 0.0),
               (0, 6, -0.0), (0, 7, 2 ** -17), (0, 8, 2 ** -18), (0, 9, 3 * 2 ** -19), (0, 10, 1e-9),
               (0, 11, -0.5), (0, 12, 1.0), (0, 13, 0.123456789), (0, 14, -1.7), (0, 15, 1.6)],
        scale_inv=0.00390625,
        scale_inv_bits=0x3B800000,
        codes={
            'div':       [126, 254, 106, 106, 105, 0, 128, 1, 0, 1, 0, 240, 120, 96, 254, 125],
            'mul_recip': [126, 254, 106, 106, 105, 0, 128, 1, 0, 1, 0, 240, 120, 96, 254, 125],
            'mul_448':   [126, 254, 106, 106, 105, 0, 128, 1, 0, 1, 0, 240, 120, 96, 254, 125],
        },
        scale_inv_ue8m0=0.00390625,
        dequant=[1.75, -1.75, 0.3125, 0.3125, 0.28125, 0.0, -0.0, 7.62939453125e-06, 0.0, 7.62939453125e-06,
                 0.0, -0.5, 1.0, 0.125, -1.75, 1.625],
    ),
    dict(
        name='FP8_B_formula_sensitivity',
        note=('amax = 0.095703125 (0x3DC40000) at [0,0], x = 0.01068115234375 (0x3C2F0000) at [0,1], -x at '
              '[127,127]; scale_inv = 7*2^-15 exactly. x/s = 50.0 exactly -> tie 48/52 -> RNE 48 (0x64); '
              'x*(1/s) = 50.0000038 -> 52 (0x65). x*(448/amax) agrees with x/s here but differs on ~0.02% '
              'of random elements'),
        tile_shape=(128, 128),
        cells=[(0, 0, 0.095703125), (0, 1, 0.01068115234375), (127, 127, -0.01068115234375)],
        scale_inv=0.000213623046875,
        scale_inv_bits=0x39600000,
        codes={
            'div':       [126, 100, 228],
            'mul_recip': [126, 101, 229],
            'mul_448':   [126, 100, 228],
        },
    ),
]
