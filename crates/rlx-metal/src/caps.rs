//! What the Metal backend needs of a device, checked when the device is opened: the Metal 3 GPU
//! family (macOS 13 or later: launch records carry `gpuAddress`es, kernels use `atomic_float`)
//! and MPSNDArrays made over a buffer at a byte offset (`initWithBuffer:offset:descriptor:`,
//! macOS 13). A device without them is refused with a `Device` error that says so, instead of
//! failing later on a selector the system does not have. Platform-neutral: `sys` asks Metal.
use rlx_ir::{Error, Result};

/// The minimum the backend needs, as the docs state it.
pub const MINIMUM: &str = "macOS 13 or later and a Metal 3 GPU (Apple silicon)";

/// What a device (and the system it runs on) offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// `supportsFamily(MTLGPUFamilyMetal3)`.
    pub metal3: bool,
    /// `MPSNDArray` instances respond to `initWithBuffer:offset:descriptor:`.
    pub ndarray_at_offset: bool,
}

/// `Ok` where the device named `name` has everything the backend needs, else the `Device` error
/// naming what is missing.
pub fn check(name: &str, caps: Capabilities) -> Result<()> {
    let mut missing = Vec::new();
    if !caps.metal3 {
        missing.push("the Metal 3 GPU family (GPU addresses in launch records, atomic_float)");
    }
    if !caps.ndarray_at_offset {
        missing.push("MPSNDArray initWithBuffer:offset:descriptor: (matrix-engine operands)");
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::Device(format!(
        "Metal device '{name}' lacks {}: the Metal backend needs {MINIMUM}",
        missing.join(" and ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_without_metal3_is_refused_with_the_minimum() {
        let all = Capabilities {
            metal3: true,
            ndarray_at_offset: true,
        };
        assert!(check("Apple M1", all).is_ok());
        let e = check(
            "AMD Radeon Pro 560",
            Capabilities {
                metal3: false,
                ..all
            },
        )
        .unwrap_err();
        assert!(matches!(e, Error::Device(_)), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("AMD Radeon Pro 560") && msg.contains("Metal 3"),
            "{msg}"
        );
        assert!(msg.contains("macOS 13"), "{msg}");
        let e = check(
            "old",
            Capabilities {
                metal3: true,
                ndarray_at_offset: false,
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("initWithBuffer:offset:descriptor:"), "{e}");
    }
}
