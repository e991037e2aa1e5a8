// rlx-metal host prelude: lets the backend's MSL kernel sources compile as C++17 on a machine
// without Metal, so their logic is tested against the CPU results. Address-space qualifiers
// vanish, `kernel` gives each kernel C linkage with the signature
// `void k(const Record&, uint thread_position_in_grid)`, and MSL's math names map to <cmath>.
// Attributes such as [[buffer(0)]] are left for the compiler to ignore (-Wno-attributes).
#include <cmath>
#include <cstdint>
#include <algorithm>
typedef unsigned int uint;
typedef unsigned long ulong;
#define kernel extern "C"
#define device
#define constant const
#define thread
using std::exp;
using std::tanh;
using std::sqrt;
using std::fabs;
using std::max;
using std::min;
