// entropy_sensitivity(..., kernel="cpp"): the per-row statistics as one C++ loop per row, for the CPU.
//
// Built at first use by _entropy_cpp.py with the machine's C++ compiler (GCC or Clang; under a second) and loaded
// with ctypes: no torch headers, no Python API. The same sums as the Triton and compiled kernels, with
// u_j = z_j - max z and e_j = e^{u_j}:
//
//     S0 = sum e_j    S1 = sum u_j e_j    S2 = sum e_j^2    S3 = sum u_j e_j^2
//
// Two reads of each row (its maximum, then the sums), nothing written per logit. The sums run in W float lanes
// (GCC/Clang vector types: one AVX-512 register, two AVX2 ones, four NEON ones), each lane its own accumulator, and
// e^u comes from a degree-6 polynomial times a power of two built from its bits (within 1e-7 relative): what lets
// one core go several times faster than eager softmax-based passes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int W = 16;
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));  // comparison masks: -1 or 0
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));  // bit patterns (wrap, never overflow)
typedef double vd __attribute__((vector_size(W * sizeof(double))));
// the float lanes sum BLOCK vectors (BLOCK * W logits), then hand their sums to double lanes: a float chain of 64
// terms instead of V / W (9,500 at V = 151,936) keeps the sums' rounding near float32's own
constexpr int64_t BLOCK = 64;

// The running maximum starts at LOW, far below any real logit: a row whose maximum is still below FLOOR had no
// finite logit at all. (The values of _entropy_compiled and _entropy_triton.)
constexpr float LOW = -2e30f;
constexpr float FLOOR = -1e30f;

inline vf splat(float x) { return vf{} + x; }
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline vu bits_of(vf v) { vu b; std::memcpy(&b, &v, sizeof b); return b; }
inline vf float_of(vu b) { vf v; std::memcpy(&v, &b, sizeof v); return v; }
inline vf select(vi mask, vf a, vf b) {
    vu m = (vu)mask;
    return float_of((m & bits_of(a)) | (~m & bits_of(b)));
}

// e^u per lane for -87 <= u <= 0 (NaN stays NaN): 2^t with t = u log2(e) = n + f, n the nearest integer (the
// float trick: adding 1.5 * 2^23 rounds to an integer and leaves it in the low bits), f in [-1/2, 1/2], 2^f a
// degree-6 polynomial (within 1e-7 of it in float32), 2^n put together from its exponent bits.
inline vf exp_nonpositive(vf u) {
    const vf magic = splat(12582912.0f);  // 1.5 * 2^23
    vf t = u * 1.4426950408889634f;
    vf r = t + magic;
    vf n = r - magic;
    vu n_bits = bits_of(r) - bits_of(magic);  // n, as the low bits of r (two's complement)
    vf f = t - n;
    vf p = f * 1.5337577497120947e-04f + 1.3399859890341759e-03f;
    p = p * f + 9.618519805371761e-03f;
    p = p * f + 5.550329014658928e-02f;
    p = p * f + 2.4022646248340607e-01f;
    p = p * f + 6.931471824645996e-01f;
    p = p * f + 1.0f;
    return p * float_of((n_bits + 127u) << 23);  // n >= -126: a normal float's exponent bits
}

inline double lane_sum(const vd& v) {
    double s = 0.0;
    for (int k = 0; k < W; k++) s += v[k];
    return s;
}

}  // namespace

// Rows r = 0 .. rows-1 of logits x (row r starts at x + r * row_stride; its vocab entries are contiguous), actions
// [rows] (int64), temperature 1 / inv_t: writes entropy, surprisal, phi [rows] (float32). Actions outside
// [0, vocab) give NaN surprisal and Phi; a row without a finite logit gives NaN everywhere; a NaN logit makes its
// row NaN. Matches the compiled kernel's _row_stats.
extern "C" void stare_entropy_rows(const float* x, int64_t rows, int64_t vocab, int64_t row_stride, float inv_t,
                                   const int64_t* actions, float* entropy, float* surprisal, float* phi) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t r = 0; r < rows; r++) {
        const float* row = x + r * row_stride;
        const int64_t body = vocab - vocab % W;
        // pass 1: the maximum of z = x / T (and LOW), in two sets of lanes
        vf m0 = splat(LOW), m1 = splat(LOW);
        int64_t j = 0;
        for (; j + 2 * W <= body; j += 2 * W) {
            vf a = load(row + j) * inv_t, b = load(row + j + W) * inv_t;
            m0 = select(a > m0, a, m0);
            m1 = select(b > m1, b, m1);
        }
        for (; j < body; j += W) {
            vf a = load(row + j) * inv_t;
            m0 = select(a > m0, a, m0);
        }
        m0 = select(m1 > m0, m1, m0);
        float m = LOW;
        for (int k = 0; k < W; k++) m = m0[k] > m ? m0[k] : m;
        for (; j < vocab; j++) m = row[j] * inv_t > m ? row[j] * inv_t : m;
        // pass 2: the four sums, BLOCK vectors at a time; the tail is one more vector padded with LOW (each pad
        // adds at most e^-87)
        vf s0, s1, s2, s3;
        vd d0 = vd{}, d1 = d0, d2 = d0, d3 = d0;
        auto add = [&](vf z) {
            vf u = z - m;
            // below -87 e^u < 2^-125: raising u to -87 changes no float32 sum (e^-87 is 1.6e-38 per logit), keeps
            // -inf logits (a masked vocabulary) from making u e^u = -inf * 0, and keeps 2^n normal. NaN stays NaN.
            u = select(u < splat(-87.0f), splat(-87.0f), u);
            vf e = exp_nonpositive(u);
            vf ue = u * e;
            s0 += e;
            s1 += ue;
            s2 += e * e;
            s3 += ue * e;
        };
        auto flush = [&]() {
            d0 += __builtin_convertvector(s0, vd);
            d1 += __builtin_convertvector(s1, vd);
            d2 += __builtin_convertvector(s2, vd);
            d3 += __builtin_convertvector(s3, vd);
        };
        for (int64_t b = 0; b < body; b += BLOCK * W) {
            s0 = s1 = s2 = s3 = splat(0.0f);
            const int64_t end = b + BLOCK * W < body ? b + BLOCK * W : body;
            for (j = b; j < end; j += W) add(load(row + j) * inv_t);
            flush();
        }
        if (body < vocab) {
            float tail[W];
            for (int k = 0; k < W; k++) tail[k] = body + k < vocab ? row[body + k] * inv_t : LOW;
            s0 = s1 = s2 = s3 = splat(0.0f);
            add(load(tail));
            flush();
        }
        // the per-row formulas, in double (float32 results): H = log S0 - S1 / S0, s_a = log S0 - u_a,
        // Phi = p_a (s_a - H) - (S2 S1 / S0 - S3) / S0^2
        const double S0 = lane_sum(d0), S1 = lane_sum(d1), S2 = lane_sum(d2), S3 = lane_sum(d3);
        if (!(m >= FLOOR)) {  // no finite logit (or a NaN maximum): no distribution
            entropy[r] = surprisal[r] = phi[r] = nan;
            continue;
        }
        const double log_s0 = std::log(S0), mean_u = S1 / S0, h = log_s0 - mean_u;
        const int64_t a = actions[r];
        double s_a = nan, ph = nan;
        if (a >= 0 && a < vocab) {
            const double z_a = static_cast<double>(row[a] * inv_t);  // the raw logit: -inf stays -inf
            s_a = log_s0 - (z_a - m);
            const double p_a = std::exp(-s_a);
            const double second = (S2 * mean_u - S3) / (S0 * S0);  // sum_j p_j^2 (s_j - H)
            ph = (p_a == 0.0 ? 0.0 : p_a * (s_a - h)) - second;   // p_a (s_a - H) -> 0 as p_a -> 0
        }
        entropy[r] = static_cast<float>(h);
        surprisal[r] = static_cast<float>(s_a);
        phi[r] = static_cast<float>(ph);
    }
}
