// IEEE half and bfloat16 <-> float, for reductions on 16-bit types (worker_agent/reduce.cc).
#pragma once

#include <cstdint>

namespace elastic {

float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);  // round to nearest even; NaN stays NaN
float Bf16ToFloat(uint16_t b);
uint16_t FloatToBf16(float f);  // round to nearest even; NaN stays NaN

}  // namespace elastic
