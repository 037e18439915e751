// bfloat16 <-> float32 for one value, shared by the extension's loops (they vectorise
// with plain integer ops, where oneDNN's scalar conversion on CPUs without bf16
// instructions took ~100 ns per element).
#pragma once

#include <cstdint>
#include <cstring>

namespace clbf16 {

inline float to_f32(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even, as torch does; NaN stays a (quiet) NaN.
inline uint16_t from_f32(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

}  // namespace clbf16
