// The row contract every attention kernel finishes with, CPU and GPU alike. Scores are in log2
// units (q.k * scale * log2 e); a row keeps its running max m and its sum l of exp2(s - ref).
#pragma once

#include <cmath>

#include "sparse_attn/platform.h"

namespace sparse_attn {

constexpr float kLn2 = 0.69314718055994530942f;

// The reference the online softmax subtracts: the running max, or 0 while the row has seen no
// visible key (m = -inf), so that exp2(-inf - ref) is 0 rather than NaN.
SA_HD float softmax_ref(float m) { return m == -INFINITY ? 0.f : m; }

// The row's natural-log LSE; -inf for a row that saw no key (l = 0).
SA_HD float row_lse(float m, float l) { return l == 0.f ? -INFINITY : (m + log2f(l)) * kLn2; }

// The output normaliser 1 / l: 0 for a row that saw no key (its output is 0); NaN stays NaN.
SA_HD float row_inv(float l) { return l == 0.f ? 0.f : 1.f / l; }

}  // namespace sparse_attn
