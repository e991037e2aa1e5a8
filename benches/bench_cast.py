"""Cast kernel speed (issue 15): 16.8M-element casts between dtypes, one compiled function per
pair with the source bound as a resident input; run with RLX_PROFILE=1 to print the kernel time
(the total over 10 calls per pair). RLX_CPU_ISA=portable compares the portable conversions with
the F16C ones."""

import numpy as np

import rlx
from rlx._arrays import _NP

N = 1 << 24
PAIRS = [("float32", "float16"), ("float16", "float32"), ("float32", "bfloat16"), ("bfloat16", "float32"),
         ("float64", "bfloat16"), ("int64", "int32")]


def main() -> None:
    x = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    for src, dst in PAIRS:
        fn = rlx.compile(lambda m, x, d=dst: x.astype(d), rlx.nn.Module(), {"x": rlx.InputSpec((N,), src)})
        fn.bind("x", (x * 1000).astype(np.int64) if src == "int64" else x.astype(_NP[src]))
        for _ in range(10):
            fn()
        print(src, dst, flush=True)
        del fn  # prints the profile (RLX_PROFILE=1)


if __name__ == "__main__":
    main()
