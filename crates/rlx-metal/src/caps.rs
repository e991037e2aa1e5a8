//! What the Metal backend needs of a device, checked when the device is opened: the Metal 3 GPU
//! family (macOS 13 or later: launch records carry `gpuAddress`es, kernels use `atomic_float`)
//! and MPSNDArrays made over a buffer at a byte offset (`initWithBuffer:offset:descriptor:`,
//! macOS 13), and unified memory (the arena is one shared buffer that numpy views read and the
//! host update writes; a discrete AMD or Intel GPU of the Metal 3 family has none). A device
//! without them is refused with a `Device` error that says so, instead of
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
    /// `hasUnifiedMemory`: the CPU and GPU share memory (Apple silicon).
    pub unified_memory: bool,
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
    if !caps.unified_memory {
        missing.push("unified memory (the arena is one buffer the host and the GPU share)");
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
            unified_memory: true,
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
                ndarray_at_offset: false,
                ..all
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("initWithBuffer:offset:descriptor:"), "{e}");
        let e = check(
            "AMD Radeon Pro W6800",
            Capabilities {
                unified_memory: false,
                ..all
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("unified memory") && e.contains("Apple silicon"),
            "{e}"
        );
    }
}
