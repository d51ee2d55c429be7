// Vectorised CPU kernels for the two hot quantizers, built by `quant kernels build` (see quant/numerics/_native.py).
//
// Why this exists: inductor's AVX2 code has no vector conversion for int32 -> uint8 or fp32 -> float8_e4m3fn
// (ATen's vec256 lacks both), so its MXFP4 and FP8 kernels fall back to a scalar loop per element there. These
// kernels are the torch kernels of mxfp4.py / fp8.py written out once with GCC vector extensions of the native register width
// (VB bytes: 32 with AVX2, 64 with AVX-512BW; wider generic vectors GCC scalarises), plus a few intrinsics where
// the generic lowering is poor (horizontal max, narrowing to bytes on AVX2). Built only for AVX2 and AVX-512. The contract is bit-identity with the eager torch kernels (tests/test_numerics_*.py).
// Compiled without -ffast-math: fp32 division and addition must round exactly as torch's do.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512BW__) && defined(__AVX512F__)
#define VB 64
#elif defined(__AVX2__)
#define VB 32
#else
#error "build with -mavx2 or -mavx512bw"
#endif

constexpr int kLanes32 = VB / 4;  // fp32 / int32 lanes per register
typedef int16_t i16v __attribute__((vector_size(VB)));
typedef uint16_t u16v __attribute__((vector_size(VB)));
typedef uint32_t u32v __attribute__((vector_size(VB)));
typedef float f32v __attribute__((vector_size(VB)));
typedef uint16_t u16h __attribute__((vector_size(VB / 2)));  // kLanes32 bf16 patterns

template <typename To, typename From>
static inline To bits(From f) {
    static_assert(sizeof(To) == sizeof(From));
    To t;
    std::memcpy(&t, &f, sizeof t);
    return t;
}

// bf16 bit patterns of the E2M1 midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 (mxfp4._MIDPOINTS_BF16): a '>' test
// of e2m1_code is '>=' against the next bit pattern up (ties go to the even code).
static const int16_t kMidpoints[7] = {0x3E80 + 1, 0x3F40, 0x3FA0 + 1, 0x3FE0, 0x4020 + 1, 0x4060, 0x40A0 + 1};

// Largest lane of non-negative int16 lanes.
static inline int hmax_i16(i16v v) {
#if VB == 64
    __m512i z = bits<__m512i>(v);
    __m256i y = _mm256_max_epi16(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64(z, 1));
#else
    __m256i y = bits<__m256i>(v);
#endif
    __m128i m = _mm_max_epi16(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
    // phminposuw finds the smallest unsigned lane: max(m) = 0x7FFF - min(0x7FFF - m)
    __m128i r = _mm_minpos_epu16(_mm_sub_epi16(_mm_set1_epi16(0x7FFF), m));
    return 0x7FFF - _mm_extract_epi16(r, 0);
}

// kLanes32 int32 lanes, each <= 0xFF, to kLanes32 bytes at `out`.
static inline void store_low_bytes(u32v v, uint8_t* out) {
#if VB == 64
    _mm_storeu_si128((__m128i*)out, _mm512_cvtepi32_epi8(bits<__m512i>(v)));
#else
    const __m256i gather = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i b = _mm256_shuffle_epi8(bits<__m256i>(v), gather);  // 4 bytes at the start of each 128-bit half
    __m256i p = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64((__m128i*)out, _mm256_castsi256_si128(p));
#endif
}

extern "C" {

int quant_native_abi(void) { return 1; }

// MXFP4 floor/even/rceil of bf16 blocks: mxfp4._bf16_scales + mxfp4._bf16_codes in one pass. x: nblocks * 32 bf16
// bit patterns; writes packed (16 bytes per block) and scales (1 byte per block). Returns 1 when some block needs
// the caller's attention (byte < 3: bf16-subnormal elements, re-encoded by the reference kernel; 255: non-finite),
// exactly the flag of _bf16_scales.
int quant_mxfp4_bf16(const uint16_t* x, int64_t nblocks, int32_t round_up_from, uint8_t* packed, uint8_t* scales) {
    constexpr int K = 64 / VB;  // registers per block of 32 bf16
    int special = 0;
    for (int64_t b = 0; b < nblocks; ++b) {
        i16v mag[K], sign[K];
        for (int k = 0; k < K; ++k) {
            i16v v;
            std::memcpy(&v, x + 32 * b + k * (VB / 2), VB);
            mag[k] = v & 0x7FFF;
            sign[k] = (i16v)(((u16v)v >> 12) & 8);  // sign -> code bit 3
        }
        i16v m = mag[0];
        for (int k = 1; k < K; ++k) m = mag[k] > m ? mag[k] : m;
        // max |x| as a bf16 pattern (non-negative floats order like their bits; NaN/Inf give exponent field 255)
        int32_t amax = hmax_i16(m);
        int32_t field = amax >> 7;           // fp32 exponent field of amax
        int32_t frac = (amax & 0x7F) << 16;  // fp32 fraction field (its low 16 bits are zero)
        int32_t byte = field - 2 + (frac >= round_up_from);
        byte = byte < 0 ? 0 : (byte > 254 ? 254 : byte);
        if (field == 255) byte = 255;
        special |= (byte < 3) | (byte == 255);
        scales[b] = (uint8_t)byte;
        // y = |x| / 2^e by subtracting e from the exponent field; int16 cannot overflow: |x| <= amax keeps y < 8,
        // and the smallest y (|x| = 0, byte 254) is -16256.
        int32_t clamped = byte < 3 ? 3 : (byte > 254 ? 254 : byte);
        int16_t shift = (int16_t)((127 - clamped) * 128);
        for (int k = 0; k < K; ++k) {
            i16v y = mag[k] + shift, code = sign[k];
            for (int i = 0; i < 7; ++i) code -= (y >= kMidpoints[i]);  // a true compare is -1
            // even element in the low nibble: each 32-bit word holds the (even, odd) codes in its two halves
            u32v w = (u32v)code;
            store_low_bytes((w & 0xF) | ((w >> 12) & 0xF0), packed + 16 * b + k * (VB / 4));
        }
    }
    return special;
}

}  // extern "C"

// fp32 -> float8_e4m3fn bits, round to nearest even: c10's fp8e4m3fn_from_fp32_value, branch-free, for inputs
// already clamped to +-448. (c10 maps NaN and |f| >= 480 to 0x7F; here NaN gives some other byte: NaN only comes
// from non-finite input, whose scale is non-finite too, and quantize_fp8_block raises for those.)
typedef int32_t i32v __attribute__((vector_size(VB)));
static inline u32v e4m3fn_bits(f32v f) {
    u32v u = bits<u32v>(f);
    u32v sign = u & 0x80000000u;
    u ^= sign;
    const uint32_t denorm_mask = 141u << 23;  // 2^14: adding it rounds to the subnormal spacing 2^-9
    u32v denorm = bits<u32v>(bits<f32v>(u) + 16384.0f) - denorm_mask;
    u32v normal = (u + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((u >> 20) & 1)) >> 20;
    // u has no sign bit: a signed compare (one instruction on AVX2, unlike an unsigned one) gives the same answer
    u32v r = (i32v)u < (int32_t)(121u << 23) ? denorm : normal;
    return (r & 0xFF) | (sign >> 24);
}

// torch.clamp(f, -448, 448), NaN passing through: maxps/minps return their second operand when one is NaN.
static inline f32v clamp448(f32v f) {
#if VB == 64
    __m512 v = _mm512_max_ps(_mm512_set1_ps(-448.0f), bits<__m512>(f));
    return bits<f32v>(_mm512_min_ps(_mm512_set1_ps(448.0f), v));
#else
    __m256 v = _mm256_max_ps(_mm256_set1_ps(-448.0f), bits<__m256>(f));
    return bits<f32v>(_mm256_min_ps(_mm256_set1_ps(448.0f), v));
#endif
}

static inline f32v load_f32(const uint16_t* p) {  // kLanes32 bf16 -> fp32
    u16h h;
    std::memcpy(&h, p, sizeof h);
    return bits<f32v>(__builtin_convertvector(h, u32v) << 16);
}

static inline f32v load_f32(const float* p) {
    f32v f;
    std::memcpy(&f, p, sizeof f);
    return f;
}

// Block FP8 over one row of tiles: fp8._quantize_tiles for rows [128, ti * 128] of `x`.
// scale[j] = max(amax_j, 448 * 2^-126) / 448, q = e4m3fn(clamp(x / scale_j, +-448)).
template <typename T>
static void fp8_tile_row(const T* x, int64_t ti, uint8_t* q, float* scale, u32v* acc) {
    const int64_t ld = ti * 128;
    // max |x| per tile on the fp32 bit patterns (NaN orders above Inf above every number, so it propagates like
    // amax), reading the rows in memory order with one accumulator per tile
    for (int64_t j = 0; j < ti; ++j) acc[j] = (u32v){};
    for (int64_t r = 0; r < 128; ++r)
        for (int64_t j = 0; j < ti; ++j) {
            u32v a = acc[j];
            for (int64_t c = 0; c < 128; c += kLanes32) {
                u32v m = bits<u32v>(load_f32(x + r * ld + j * 128 + c)) & 0x7FFFFFFFu;
                a = m > a ? m : a;
            }
            acc[j] = a;
        }
    for (int64_t j = 0; j < ti; ++j) {
        uint32_t amax_bits = 0;
        for (int i = 0; i < kLanes32; ++i) amax_bits = acc[j][i] > amax_bits ? acc[j][i] : amax_bits;
        float amax = bits<float>(amax_bits);
        const float floor = 448.0f * 0x1p-126f;
        scale[j] = (amax < floor ? floor : amax) / 448.0f;  // like torch.clamp(amax, min=floor), NaN stays NaN
    }
    for (int64_t r = 0; r < 128; ++r)
        for (int64_t j = 0; j < ti; ++j) {
            const float s = scale[j];
            for (int64_t c = 0; c < 128; c += kLanes32) {
                f32v f = clamp448(load_f32(x + r * ld + j * 128 + c) / s);
                store_low_bytes(e4m3fn_bits(f), q + r * ld + j * 128 + c);
            }
        }
}

extern "C" {

// x [nrows, 128, ti, 128] (contiguous tile rows, as fp8._quantize_tiles gets them) -> q of the same shape and
// scale [nrows, ti].
void quant_fp8_tiles_bf16(const uint16_t* x, int64_t nrows, int64_t ti, uint8_t* q, float* scale) {
    u32v* acc = new u32v[ti];
    for (int64_t t = 0; t < nrows; ++t)
        fp8_tile_row(x + t * 128 * ti * 128, ti, q + t * 128 * ti * 128, scale + t * ti, acc);
    delete[] acc;
}

void quant_fp8_tiles_f32(const float* x, int64_t nrows, int64_t ti, uint8_t* q, float* scale) {
    u32v* acc = new u32v[ti];
    for (int64_t t = 0; t < nrows; ++t)
        fp8_tile_row(x + t * 128 * ti * 128, ti, q + t * 128 * ti * 128, scale + t * ti, acc);
    delete[] acc;
}

}  // extern "C"
