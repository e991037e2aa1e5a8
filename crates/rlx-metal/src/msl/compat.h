// rlx-metal host prelude: lets the backend's MSL kernel sources compile as C++17 on a machine
// without Metal, so their logic is tested against the CPU results. Address-space qualifiers
// vanish, `kernel` gives each kernel C linkage with the signature
// `void k(const P&, uint thread_position_in_grid)`, MSL's math names map to <cmath>, and the
// two atomics become plain accesses (the host runs a dispatch's threads one after another).
// Attributes such as [[buffer(0)]] are left for the compiler to ignore (-Wno-attributes).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
typedef unsigned int uint;
typedef unsigned long ulong;
#define kernel extern "C"
#define device
#define constant const
#define thread
using std::copysign;
using std::exp;
using std::fabs;
using std::floor;
using std::fmod;
using std::log;
using std::max;
using std::min;
using std::pow;
using std::sqrt;
using std::tanh;
template <typename T> inline T as_type(uint v) {
    T r;
    std::memcpy(&r, &v, sizeof r);
    return r;
}
inline void rx_atomic_add(float* p, float v) { *p += v; }
// Records the first failure of a run (code, value) in the error word.
inline void rx_fail(int* err, int code, int value) {
    if (err[0] == 0) {
        err[0] = code;
        err[1] = value;
    }
}
